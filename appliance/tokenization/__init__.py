"""Text <-> token ids as vLLM computes them for a model directory, shared by the live
appliance (the router tokenises sessions) and the simulated engine: the tokenizer and its
loading (`tokenizer`), chat templates (`chat_template`). Stdlib, jinja2 and tokenizers only."""
