"""What a checkpoint saves (private): the portable state dict handed to DCP, and its planners.

Layouts checked and repaired (``_repair.py``), fused parameters split into components
(``_components.py``), FP8 made plain, tied tensors stored once, frameworks' own state dicts
(``_provider.py``), the chunk objects and DCP planners (``_chunks.py``), host staging for
asynchronous saves (``_stage.py``), RNG states (``_rng.py``). Nothing here knows where or how the
bytes land: that is ``checkpoint/storage``.
"""
