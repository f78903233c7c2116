"""Writers of checkpoints for tests, benchmarks and the first-use default model: the presets
(random weights in the releases' layouts, a trained byte-level tokenizer, chat templates, block
FP8, real shapes for `--load-format dummy`) and the MTP head fitter. `hybrid-serve make-model`
is their command line. The serving path never imports this package, except to write the default
`tiny` model the first time the server starts without `--model-path`."""
