"""Run in SGLang's environment: read the messages a test wrote (`mmferry.server.sglang_wire`)
with SGLang's own receiver code, and print what it made of them as JSON.

argv: a folder holding `N.head` (and `N.rows`) per message, and the model type. For each
message, SGLang's allow-list unpickler loads the head, the rows are read as its receiver reads
them, and the parts of one request are folded into its aggregate; the aggregate's per-modality
rows and the metadata it hands the multimodal processor are printed. It also prints the state
SGLang's own encoder pickles (an EmbeddingData as its encoder builds one), to pin the fields.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import torch
from sglang.srt.disaggregation.encoder import receiver
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.utils.common import safe_pickle_loads


def plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Modality):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def main() -> None:
    folder, model_type = Path(sys.argv[1]), sys.argv[2]
    heads = sorted(folder.glob("*.head"), key=lambda p: int(p.stem))
    out = {"messages": [], "aggregates": {}}
    aggregates = {}
    for head in heads:
        obj = safe_pickle_loads(head.read_bytes())
        assert isinstance(obj, receiver.EmbeddingData), type(obj)
        rid = receiver.extract_original_req_id(obj.req_id)
        assert receiver._embedding_part_matches_request(obj, rid)
        doc = {k: plain(v) for k, v in vars(obj).items()}
        out["messages"].append(doc)
        if obj.error_msg is not None:
            continue
        raw = bytearray(head.with_suffix(".rows").read_bytes())
        obj.embedding = torch.frombuffer(raw, dtype=obj.dtype).reshape(obj.shape).clone()
        aggregates[rid] = receiver._aggregate_embedding_part(aggregates.get(rid), obj, model_type)
    for rid, agg in aggregates.items():
        rows = agg.get_embedding(is_concat=True)
        out["aggregates"][rid] = {
            "ready": agg.ready,
            "rows": {m.name: t.to(torch.float64).sum().item() for m, t in rows.items()},
            "shapes": {m.name: list(t.shape) for m, t in rows.items()},
            "meta": {k: plain(v) for k, v in agg.get_mm_extra_meta().items()},
        }
    own = receiver.EmbeddingData(
        "r_local_part_0", 1, 0, torch.tensor([[1, 4, 4]]), Modality.VIDEO,
        embedding=torch.zeros(4, 8), video_timestamps=[[0.5]], second_per_grid_ts=[1.0],
    )  # fmt: skip
    out["sglang_state"] = sorted(vars(pickle.loads(pickle.dumps(own.copy_without_embedding()))))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
