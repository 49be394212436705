"""Pack a trained drafter folder for shipping: weights re-saved (int8 matrices with ``--int8``), its STS
temperatures, calibration report and plots copied beside them, all written atomically.

    python -m train.pack_drafter --draft runs/dspark/export --out dspark_jax/assets/drafters/dspark --int8

The training plot is taken from the run folder (``training.png`` next to ``export/``) when present.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dspark_jax.models import drafter_files

SIDE_FILES = ("sts.json", "calibration.json", "reliability.png")


def pack(src: str | Path, out: str | Path, *, int8: bool = False) -> Path:
    src = Path(src)
    drafter, meta = drafter_files.load_drafter(src)
    attach = [src / f for f in SIDE_FILES if (src / f).is_file()]
    plots = [f for f in (src / "training.png", src.parent / "training.png") if f.is_file()]
    attach += plots[:1]  # the export's own plot, else the run folder's
    extra = {k: v for k, v in meta.items() if k != "config"}
    extra["storage"] = "int8 matrices, per-channel float32 scales" if int8 else "float16"
    return drafter_files.save_drafter(drafter, out, extra=extra, quantize="int8" if int8 else None, attach=attach)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, help="drafter folder (config.json + weights.npz)")
    p.add_argument("--out", required=True, help="folder to write (replaced atomically)")
    p.add_argument("--int8", action="store_true", help="store weight matrices as int8 (about half the size)")
    args = p.parse_args(argv)
    if Path(args.out).resolve() == Path(args.draft).resolve():
        p.error("--out must differ from --draft (the source is read while the copy is written)")
    if not ((Path(args.draft) / "config.json").is_file() and (Path(args.draft) / "weights.npz").is_file()):
        p.error(f"--draft {args.draft}: expected a drafter folder with config.json and weights.npz (ours; a DeepSpec "
                f"checkpoint is read by --draft directly, not packed)")
    out = pack(args.draft, args.out, int8=args.int8)
    files = sorted(out.iterdir())
    print(json.dumps({"out": str(out), "files": [f.name for f in files], "bytes": sum(f.stat().st_size for f in files)}))


if __name__ == "__main__":
    main()
