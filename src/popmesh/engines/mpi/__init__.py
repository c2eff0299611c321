"""The MPI adapter (mpi4py): collectives, point-to-point transport and one-sided windows."""
