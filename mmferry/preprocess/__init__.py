"""preprocess stage of mmferry: sources -> `MultimodalItem`s (producer side, CPU).

decode (image sources -> upright RGB) / video_decode (PyAV) -> sampling (frames, timestamps,
per-frame budget) -> resize (smart_resize) -> patchify (hf or compact-u8 rows) -> hashing;
image.py and video.py tie them together, batch.py runs many of them on threads; buffers.py
holds the huge-page output allocator; threads.py the thread policy.
"""
