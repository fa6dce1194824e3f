"""A GPU-less engine that speaks vLLM 0.32's protocols, checked against real vLLM."""
