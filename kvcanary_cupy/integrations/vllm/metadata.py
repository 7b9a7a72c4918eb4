"""One layer's attention metadata of a step, read as the step read needs it: one row per request in the input
batch's order, whatever way the backend splits the batch (vLLM's MLA metadata keeps decodes and prefills in two
halves)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..._errors import fail


def attention_metadata(metadata: Any) -> Any:
    """The step's attention metadata of one layer with the four fields the step read takes (``query_start_loc``,
    ``seq_lens``, ``block_table``, ``slot_mapping``), one row per request in the input batch's order.

    Most backends' metadata has them as they are. vLLM's MLA metadata (``MLACommonMetadata``) splits the batch,
    decodes first (the MLA builder reorders the input batch that way), into ``decode`` (``block_table``,
    ``seq_lens``) and ``prefill`` (``block_table``, ``query_lens_cpu`` and, when a prefill has cached context,
    ``chunked_context.context_lens_list``): the two halves are put back together here, without copying the
    block tables' rows out of order."""
    if hasattr(metadata, "seq_lens") and hasattr(metadata, "block_table"):
        return metadata
    decode, prefill = getattr(metadata, "decode", None), getattr(metadata, "prefill", None)
    if decode is None and prefill is None:
        fail(f"the attention metadata {type(metadata).__name__} has no seq_lens/block_table and no MLA "
             "decode/prefill parts to read them from")
    import torch

    tables, lens = [], []
    if decode is not None:
        tables.append(decode.block_table)
        lens.append(decode.seq_lens.to("cpu", torch.int64))
    if prefill is not None:
        tables.append(prefill.block_table)
        queries = prefill.query_lens_cpu.to(torch.int64)
        context = getattr(prefill.chunked_context, "context_lens_list", None)
        lens.append(queries + torch.tensor(context, dtype=torch.int64) if context is not None else queries)
    seq_lens = torch.cat(lens)
    return SimpleNamespace(query_start_loc=metadata.query_start_loc, slot_mapping=metadata.slot_mapping,
                           seq_lens=seq_lens, block_table=torch.cat([t.to("cpu") for t in tables]))


__all__ = ["attention_metadata"]
