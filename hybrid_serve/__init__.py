"""hybrid-serve: an inference server for hybrid recurrent/attention language models.

The one import name of the project. Its packages, in dependency order:
`server -> scheduler -> models -> kernels`, `scheduler -> mem_cache`, and `make_model` (the
checkpoint writers behind `hybrid-serve make-model`). Importing this package imports nothing else.
"""
