"""The model endpoints: OpenAI chat and completions, the Anthropic Messages API, the Responses API;
reading a turn's request, refusing one too long for the context, and shaping its answer."""
