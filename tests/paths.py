"""The traces the tests replay, carried in `tests/data/` (each folder's README.md gives the
source, licence, slicing command and checksums). A missing file fails the import, naming its
path: no test skips, or reaches outside the checkout, for want of data."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def data_file(relative: str) -> Path:
    path = DATA / relative
    if not path.is_file():
        raise FileNotFoundError(f"test data missing: {path} (tests/data is part of the checkout)")
    return path


# The first 1,000 of the conversation trace's 12,031 requests.
MOONCAKE = data_file("traces/mooncake_fast25/conversation_trace_first1000.jsonl")
# The whole code trace, with the statistics computed from it.
AZURE = data_file("traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv")
AZURE_STATS = data_file("traces/azure_llm_2023/AzureLLMInferenceTrace_code.stats.json")
