"""The host: what a process and its files need before any model: writing files whole, where
outputs may go, content digests, scratch folders, the BLAS and command-queue re-exec, bounded
asynchronous evaluation, prefetch and the ranks' rendezvous. The lowest floor: it imports no
other wing.
"""
