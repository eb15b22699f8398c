"""Whether a checkpoint file is whole: cheap checks that its writer did not die mid-write.

One rule for every reader: the sealer and completion (onbox/sealing/discovery.py) seal and pull
only whole files, and the training API (onbox/train/lightning.py) resumes only from one.
"""

from __future__ import annotations

import json
import os

from onbox.common.safepath import NotRegularFile, open_regular


def looks_whole(path: str) -> bool:
    """Cheap checks that a file of a known format is not torn (its writer died mid-write and the
    kernel closed it): a zip (torch.save's format) must end with its central directory; a
    safetensors file must hold as many bytes as its header says. Other formats pass. Anything
    but a regular file (a FIFO named ``step_5.pt`` would hang a plain open) is not whole."""
    try:
        with open(open_regular(path), "rb") as f:
            head = f.read(8)
            if head[:4] == b"PK\x03\x04":
                import zipfile

                return zipfile.is_zipfile(f)
            if path.endswith(".safetensors") and len(head) == 8:
                n = int.from_bytes(head, "little")
                header = json.loads(f.read(n))
                end = max(
                    [
                        0,
                        *(
                            int(v["data_offsets"][1])
                            for k, v in header.items()
                            if k != "__metadata__"
                        ),
                    ]
                )
                return bool(os.fstat(f.fileno()).st_size == 8 + n + end)
    except (OSError, ValueError, KeyError, TypeError, IndexError, NotRegularFile):
        return False
    return True
