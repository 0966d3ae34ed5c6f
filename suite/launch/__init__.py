"""Process machinery: the elastic launcher (one process per rank, rendezvous, restarts) and the fork
server that starts ranks and pipeline stages from one warm interpreter."""
