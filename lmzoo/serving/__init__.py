"""The generation engine: `slots` (the device side: a KV cache of slots, prefills, chunks of decode steps) and
`engine` (the host side: continuous batching of requests). `python -m lmzoo.cli.serve` serves it over HTTP."""
