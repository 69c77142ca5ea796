"""The calls Triton's ``compile()`` makes on its cache manager, and a check that warmstart's manager
leaves, for the same calls, the files Triton's own ``FileCacheManager`` leaves.

Run as a script (``python _triton_protocol.py DIR``) in a process that can import Triton, it prints
one JSON line: the differences found (an empty list when there are none). The tests run it where
Triton is installed, or with the reference Triton ``make setup`` installs beside the venv on
machines without a GPU: importing ``triton.runtime.cache`` needs no GPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class IRText:
    """What Triton hands ``put`` for its ``.ttir`` and ``.ttgir`` stages: an IR module object, not
    bytes, whose ``str()`` is the module's text (``triton._C.libtriton.ir.module``)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


METADATA = {"name": "k", "num_warps": 4}


def compile_as_triton_does(manager, cubin: bytes) -> dict[str, str]:
    """The manager calls of ``triton.compiler.compile`` (Triton 3.6, ``triton/compiler/compiler.py``)
    for one kernel ``k`` that missed: a group lookup under the metadata file's name, each stage
    ``put`` (text, IR modules, the binary), the metadata as text, then the group under that name.
    Returns the group: file name -> local path."""
    assert manager.get_group("k.json") is None
    group = {
        "k.source": manager.put("@triton.jit\ndef k(): pass", "k.source"),
        "k.ttir": manager.put(IRText("module { tt.func @k() }"), "k.ttir"),
        "k.ttgir": manager.put(IRText("module attributes {ttg.num-warps = 4} {}"), "k.ttgir"),
        "k.llir": manager.put("define void @k() { ret void }", "k.llir"),
        "k.ptx": manager.put(".visible .entry k()", "k.ptx"),
        "k.cubin": manager.put(cubin, "k.cubin"),
    }
    group["k.json"] = manager.put(json.dumps(METADATA), "k.json", binary=False)
    manager.put_group("k.json", group)
    return group


def _contents(directory: str) -> dict[str, bytes]:
    files = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = f.read()
    return files


def differences_from_triton(work: Path) -> list[str]:
    """Make the calls through both managers, in directories under ``work``; what differs: the files
    each leaves, their bytes (for a group file: the children it names), and what ``get_group``
    returns to the next compile."""
    from triton.runtime.cache import FileCacheManager

    from warmstart.compile_cache.triton_manager import WarmstartCacheManager

    cubin = os.urandom(3000)
    managers = {}
    for label, cls in (("warmstart", WarmstartCacheManager), ("triton", FileCacheManager)):
        os.environ["TRITON_CACHE_DIR"] = str(work / label)
        managers[label] = cls("KSAME")
        compile_as_triton_does(managers[label], cubin)
    ours, theirs = (_contents(managers[label].cache_dir) for label in ("warmstart", "triton"))
    found = []
    if sorted(ours) != sorted(theirs):
        found.append(f"files: warmstart {sorted(ours)}, Triton {sorted(theirs)}")
    for name in sorted(set(ours) & set(theirs)):
        if name.startswith("__grp__"):
            mine, own = (set(json.loads(files[name])["child_paths"]) for files in (ours, theirs))
            if mine != own:
                found.append(f"{name} names {sorted(mine)}, Triton's {sorted(own)}")
        elif ours[name] != theirs[name]:
            found.append(f"{name}: other bytes than Triton's")
    groups = {label: manager.get_group("k.json") for label, manager in managers.items()}
    if groups["warmstart"] is None or groups["triton"] is None or set(groups["warmstart"]) != set(groups["triton"]):
        found.append(f"get_group: warmstart {groups['warmstart']}, Triton {groups['triton']}")
    else:
        with open(groups["warmstart"]["k.json"]) as f:
            if json.load(f) != METADATA:
                found.append("the group's k.json is not the metadata")
    return found


if __name__ == "__main__":
    print(json.dumps(differences_from_triton(Path(sys.argv[1]))))
