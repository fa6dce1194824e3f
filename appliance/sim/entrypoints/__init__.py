"""A simulated worker over HTTP, in vLLM 0.32's shapes: the server and its serving, the
requests it reads, its response bodies (completions, chat, Responses API), errors,
tool calls and structured output, the detokenizer, dev routes, /metrics, and the
`python -m` entry that takes vLLM's command line."""
