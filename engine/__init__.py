"""Ray-free runtime: caches, requests, sampling, step planning, tokenizer, the stock engine."""
