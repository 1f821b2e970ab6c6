"""Sample data: small committed inputs and the generator of the demo lake."""

from pathlib import Path

__all__ = ["MOONCAKE_CONVERSATION"]

# The Mooncake FAST'25 conversation trace (Apache-2.0; see MOONCAKE_NOTICE.md beside it).
MOONCAKE_CONVERSATION = Path(__file__).with_name("conversation_trace.jsonl.gz")
