"""Where the tests find the shared reference material: `shared/` beside the checkout (CI
lays it there) or inside it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = next((p for p in (ROOT.parent / "shared", ROOT / "shared") if p.is_dir()),
              ROOT.parent / "shared")  # fmt: skip
MOONCAKE = SHARED / "traces/mooncake_fast25/conversation_trace.jsonl"
AZURE = SHARED / "traces/azure_llm_2023/AzureLLMInferenceTrace_code.csv"
