"""The torch.distributed adapter: collectives over a process group and its point-to-point transport."""
