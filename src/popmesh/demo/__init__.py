"""The CartPole population demo behind ``popmesh demo``: a user of everything below it."""
