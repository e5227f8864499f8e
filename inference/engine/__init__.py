"""The decoding engine: plain and Medusa steps, their tree, cache and sampling, and the device kernels.

Nothing here imports the runtime (inference.runtime) or a command line: it takes a model, heads, a tree and
a request, and yields tokens."""
