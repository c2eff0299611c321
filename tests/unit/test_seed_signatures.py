"""The seed-document parser and the facade checker: synthetic documents of both flavours, then the real five."""

from __future__ import annotations

import abc
import types

import pytest
from seed_signatures import (
    Param,
    default_matches,
    facade_mismatches,
    find_seeds_dir,
    load_seeds,
    parse_params,
    parse_seed,
)

RENDERED = """\
mod
Functions
alpha(a[, b, ...])
trunc(a)
Data
mod.CONST

\u2018A\u2019
mod.alpha(a: collections.abc.Callable[[int, str], int], b=2**3, *rest, c: dict[str, int] = {'k': (1, 2)}, **kw)[source]#
Alpha, documented.
>>> alpha(1)
3
Parameters:
mod._private(x)[source]
- mod.gamma(x,
    y=None)#
class mod.Thing(p, q='a,b')[source]
mod.Thing.run(n=0)
mod.trunc(a, b=1, c
"""

DIRECTIVES = (
    ".. py:module:: pkg Classes ------- .. autoapisummary:: pkg.Policy pkg._hidden Functions --------- "
    ".. autoapisummary:: pkg.run Module Contents ---------------\n"
    ".. py:class:: Policy(every, ratio = 0.2, group = MPI.COMM_WORLD) Bases: :py:obj:`Base` A policy.\n"
    ".. py:attribute:: _secret :value: 1\n"
    ".. py:method:: __call__(it, model, metric = None) :abstractmethod: Possibly step.\n"
    ".. py:method:: weights(metrics) :staticmethod:\n"
    ".. py:method:: _helper()\n"
    ".. py:attribute:: age_range :value: (50, 150)\n"
    ".. py:data:: default_backend :value: 'mpi'\n"
    ".. py:function:: run(*names, default = None) Run them.\n"
    "    :param names: the names.\n"
    ".. py:function:: _first_env(*names, default = None) Private."
)


def _sig(entry):
    return [(p.name, p.kind, p.default) for p in entry.params]


def test_rendered_flavour():
    seed = parse_seed(RENDERED, "mod")
    assert set(seed.entries) == {"CONST", "alpha", "gamma", "Thing", "Thing.run", "trunc"}
    assert seed.entries["CONST"].kind == "data" and seed.entries["CONST"].value == "'A'"
    alpha = seed.entries["alpha"]
    assert _sig(alpha) == [
        ("a", "POSITIONAL_OR_KEYWORD", None), ("b", "POSITIONAL_OR_KEYWORD", "2 ** 3"),
        ("rest", "VAR_POSITIONAL", None), ("c", "KEYWORD_ONLY", "{'k': (1, 2)}"), ("kw", "VAR_KEYWORD", None),
    ]
    assert alpha.params[0].annotation == "collections.abc.Callable[[int, str], int]"
    assert [(e.source, e.want) for e in alpha.examples] == [(("alpha(1)",), ("3",))]
    assert _sig(seed.entries["gamma"]) == [
        ("x", "POSITIONAL_OR_KEYWORD", None), ("y", "POSITIONAL_OR_KEYWORD", "None")]
    assert seed.entries["Thing"].kind == "class"
    assert _sig(seed.entries["Thing"])[1] == ("q", "POSITIONAL_OR_KEYWORD", "'a,b'")  # the comma is quoted
    assert seed.entries["Thing.run"].kind == "method" and seed.members("Thing") == {"run": seed.entries["Thing.run"]}
    trunc = seed.entries["trunc"]
    assert "truncated" in trunc.flags and [p.name for p in trunc.params] == ["a", "b", "c"]
    assert seed.summary == {"alpha": ("a", "b"), "trunc": ("a",)}
    assert seed.public_names() == {"CONST", "alpha", "gamma", "Thing", "trunc"}


def test_directive_flavour():
    seed = parse_seed(DIRECTIVES, "pkg")
    assert set(seed.entries) == {"Policy", "Policy.__call__", "Policy.weights", "Policy.age_range",
                                 "default_backend", "run"}
    assert _sig(seed.entries["Policy"]) == [
        ("every", "POSITIONAL_OR_KEYWORD", None), ("ratio", "POSITIONAL_OR_KEYWORD", "0.2"),
        ("group", "POSITIONAL_OR_KEYWORD", "MPI.COMM_WORLD"),
    ]
    assert seed.entries["Policy.__call__"].flags == {"abstractmethod"}
    assert seed.entries["Policy.weights"].flags == {"staticmethod"}
    age_range = seed.entries["Policy.age_range"]
    assert age_range.kind == "attribute" and age_range.value == "(50, 150)"
    assert seed.entries["default_backend"].kind == "data" and seed.entries["default_backend"].value == "'mpi'"
    assert _sig(seed.entries["run"]) == [("names", "VAR_POSITIONAL", None), ("default", "KEYWORD_ONLY", "None")]
    assert ":param names:" in seed.entries["run"].doc
    assert seed.summary == {"Policy": None, "run": None}


def test_argument_text_that_is_not_python_is_split_by_hand():
    assert parse_params("f=<function g at 0x1>, *, k: dict[str, int]={'a': 1}, **kw") == (
        Param("f", "POSITIONAL_OR_KEYWORD", "<function g at 0x1>"),
        Param("k", "KEYWORD_ONLY", "{'a': 1}", "dict[str, int]"),
        Param("kw", "VAR_KEYWORD"),
    )


def _attach(state, params):
    return state


@pytest.mark.parametrize(("text", "value", "same"), [
    ("2**18", 262144, True), ("2 ** 18", 2**18, True), ("2**18", 2**17, False), ("0", False, False),
    ("False", False, True), ("0.2", 0.2, True), ("-1", -1, True), ("(50, 150)", (50, 150), True),
    ("(50, 150)", [50, 150], False), ("'mpi'", "mpi", True), ("\u2018mpi\u2019", "mpi", True),
    ("None", None, True), ("None", 0, False), ("_attach", _attach, True), ("_detach", _attach, False),
])
def test_default_matches(text, value, same):
    assert default_matches(text, value) is same


def test_names_resolve_in_the_facade_namespace():
    world, other = object(), object()
    namespace = {"MPI": types.SimpleNamespace(COMM_WORLD=world), "alias": _attach}
    assert default_matches("MPI.COMM_WORLD", world, namespace)
    assert not default_matches("MPI.COMM_WORLD", other, namespace)
    assert default_matches("alias", _attach, namespace) and not default_matches("alias", len, namespace)


GOOD = '''
import abc
MPI = __import__("types").SimpleNamespace(COMM_WORLD=object())
default_backend = "mpi"
__all__ = ["Policy", "default_backend", "run"]
class Policy(abc.ABC):
    def __init__(self, every, ratio=0.2, group=MPI.COMM_WORLD): pass
    @abc.abstractmethod
    def __call__(self, it, model, metric=None): pass
    @staticmethod
    def weights(metrics): pass
def run(*names, default=None): pass
'''


def _module(source: str) -> types.ModuleType:
    module = types.ModuleType("facade")
    exec(source, module.__dict__)
    return module


def test_facade_checker_accepts_a_faithful_facade_and_names_each_difference():
    seed = parse_seed(DIRECTIVES, "pkg")
    assert facade_mismatches(_module(GOOD), seed) == []
    bad = (GOOD.replace("ratio=0.2", "ratio=0.25").replace("    @staticmethod\n", "")
           .replace("    @abc.abstractmethod\n", "").replace('"mpi"', '"torch"').replace("default=None", "default=0")
           .replace('"run"]', '"run", "extra"]').replace("group=MPI.COMM_WORLD", "group=None"))
    problems = "\n".join(facade_mismatches(_module(bad), seed))
    for expected in ("Policy: ratio default", "Policy: group default", "Policy.weights: seed says staticmethod",
                     "Policy.__call__: seed says abstractmethod", "default_backend: value 'torch'",
                     "run: default default", "__all__: extra ['extra']"):
        assert expected in problems
    renamed = _module(GOOD.replace("def run(*names, default=None)", "def run(names, default=None)"))
    assert facade_mismatches(renamed, seed) == [
        "run: parameters (names, default=None), seed has (*names, default=None)"]
    assert facade_mismatches(_module(GOOD.replace("def run", "def walk")), seed) == ["run: missing"]
    assert isinstance(_module(GOOD).Policy, abc.ABCMeta)


def test_what_a_facade_declares_newer_than_its_seed_is_accepted_and_nothing_else():
    seed = parse_seed(DIRECTIVES, "pkg")
    grown = (GOOD.replace('"run"]', '"run", "Layout"]')
             .replace("class Policy(abc.ABC):", "class Layout: pass\nclass Policy(abc.ABC):")
             .replace("def __init__(self, every, ratio=0.2,", "def __init__(self, every=1, ratio=0.2, lead=0,")
             .replace("metric=None): pass", "metric=None, *, k=2): pass"))
    declared = "\n__newer__ = {'Layout': (), 'Policy': ('every', 'lead'), 'Policy.__call__': ('k',)}\n"
    assert facade_mismatches(_module(grown + declared), seed) == []
    undeclared = "\n".join(facade_mismatches(_module(grown), seed))
    for expected in ("__all__: extra ['Layout']", "Policy: every default", "Policy: parameters (every=1, ratio=0.2, "
                     "lead=0, group=", "Policy.__call__: parameters (it, model, metric=None, k=2)"):
        assert expected in undeclared, undeclared
    no_default = grown.replace("every=1, ratio=0.2, lead=0,", "every, lead, ratio=0.2,")
    problems = facade_mismatches(_module(no_default + declared), seed)
    assert "Policy: lead, added after the seed, has no default" in problems, problems
    unexported = grown.replace('"run", "Layout"]', '"run"]') + declared
    assert facade_mismatches(_module(unexported), seed) == ["__newer__: Layout is not exported"]


# ---------------------------------------------------------------------------------- the real documents


@pytest.fixture(scope="module")
def seeds():
    if find_seeds_dir() is None:
        pytest.skip("seed documents not found: set POPMESH_SEEDS_DIR or check out ../shared/seeds")
    return load_seeds()


def test_all_five_documents_parse_completely(seeds):
    assert set(seeds) == {"evorl.distributed", "gfn.utils.distributed", "omnisafe.utils.distributed",
                          "spawn_policy", "xlstm_jax.distributed.data_parallel"}
    for seed in seeds.values():
        assert all(e.params is not None for e in seed.top("function").values()), seed.module
        assert not any(name.startswith("_") for name in seed.public_names()), seed.module
        for name, listed in seed.summary.items():  # every name the summary table lists was found in full
            assert name in seed.entries, (seed.module, name)
            if listed is not None:
                assert tuple(p.name for p in seed.entries[name].params[: len(listed)]) == listed
        assert not any("truncated" in e.flags for e in seed.entries.values())


def test_evorl(seeds):
    seed = seeds["evorl.distributed"]
    assert sorted(seed.top("function")) == [
        "agent_gradient_update", "all_gather", "get_global_ranks", "get_process_id", "gradient_update",
        "is_dist_initialized", "pmax", "pmean", "pmin", "psum", "shmap_map", "shmap_vmap",
        "split_key_to_devices", "tree_device_put",
    ]
    assert {n: e.value for n, e in seed.top("data").items()} == {"DP_AXIS_NAME": "'DP'", "POP_AXIS_NAME": "'POP'"}
    assert _sig(seed.entries["gradient_update"])[2] == ("dp_axis_name", "POSITIONAL_OR_KEYWORD", None)
    assert [p.default for p in seed.entries["agent_gradient_update"].params] == [
        None, None, "None", "False", "_attach_params_to_agent_state", "_detach_params_to_agent_state"]
    assert _sig(seed.entries["all_gather"])[-1] == ("kwargs", "VAR_KEYWORD", None)


def test_gfn(seeds):
    seed = seeds["gfn.utils.distributed"]
    assert len(seed.top("function")) == 16 and set(seed.top("data")) == {"Group", "default_backend", "logger"}
    assert [(p.name, p.default) for p in seed.entries["send"].params] == [
        ("data", None), ("dst_rank", None), ("backend", "default_backend"), ("tag", "0")]
    assert [p.name for p in seed.entries["recv"].params] == ["src_rank", "backend", "tag"]
    assert seed.entries["default_backend"].value == "'mpi'"
    assert set(seed.top("class")) == {"AsyncSendHandle", "DistributedContext", "DistributedContextMPI4Py"}
    assert seed.entries["DistributedContext"].params is None  # a dataclass: no constructor shown
    assert set(seed.members("AsyncSendHandle")) == {"is_complete", "wait"}
    assert _sig(seed.entries["DistributedContext.get_train_group"]) == [("backend", "POSITIONAL_OR_KEYWORD", "'mpi'")]
    assert seed.entries["DistributedContext.my_rank"].kind == "attribute"


def test_omnisafe(seeds):
    seed = seeds["omnisafe.utils.distributed"]
    assert len(seed.top("function")) == 15 and not seed.top("class", "data")
    assert [(p.name, p.default) for p in seed.entries["fork"].params] == [
        ("parallel", None), ("bind_to_core", "False"), ("use_number_of_threads", "False"), ("device", "'cpu'"),
        ("manual_args", "None")]
    assert [(p.name, p.default) for p in seed.entries["dist_statistics_scalar"].params] == [
        ("value", None), ("with_min_and_max", "False")]
    example = seed.entries["dist_statistics_scalar"].examples[0]
    assert example.source[-1] == "dist_statistics_scalar(x)" and example.want == ("(tensor(1.5), tensor(0.5))",)
    assert seed.entries["dist_avg"].examples[0].want == ("tensor(1.5)",)  # the stray :rtype: line is skipped


def test_spawn_policy(seeds):
    seed = seeds["spawn_policy"]
    assert not seed.top("function") and set(seed.top("data")) == {"logger"}
    assert len(seed.top("class")) == 6
    assert [(p.name, p.default) for p in seed.entries["AsyncSelectiveAveragingPolicy"].params] == [
        ("model_builder", None), ("average_every", None), ("replacement_ratio", "0.2"),
        ("averaging_strategy", "'mean'"), ("momentum", "0.0"), ("poll_interval_s", "0.01"), ("threshold", "None"),
        ("cooldown", "200"), ("timing", "None")]
    fast = seed.entries["AsyncSelectiveAveragingPolicympi4pyFast"]
    assert [p.default for p in fast.params][-3:] == ["(50, 150)", "'age'", "MPI.COMM_WORLD"]
    assert seed.entries["SpawnPolicy.__call__"].flags == {"abstractmethod"}
    assert [p.name for p in seed.entries["AverageAllPolicy.__call__"].params] == [
        "iteration", "model", "optimizer", "local_metric", "group"]
    assert "_background_loop" not in seed.members("AsyncSelectiveAveragingPolicy")


def test_xlstm(seeds):
    seed = seeds["xlstm_jax.distributed.data_parallel"]
    assert list(seed.top()) == ["shard_params", "gather_array_with_mean_grads", "gather_params",
                                "shard_module_params", "sync_gradients"]
    assert _sig(seed.entries["shard_params"])[2] == ("min_weight_size", "POSITIONAL_OR_KEYWORD", "2 ** 18")
    assert not any(e.examples for e in seed.entries.values())
