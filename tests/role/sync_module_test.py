#!/usr/bin/env python3
"""role/files/sync-module, the ExecStartPre= that copies a pool's module into its working copy.

Every slot of a pool runs it on the pool's one working copy, also while another slot's tofu reads
the module there. Checked here, in temporary directories: the copy equals the source; what tofu
wrote (state, workspaces, .terraform, the lock file when the module has none) stays; a second run
on an unchanged module rewrites nothing (every file keeps its inode); a changed file is replaced
by a rename (a new inode) and the others are left alone; what left the source goes; a file that
became a directory, a symbolic link and the executable bit follow the source; a dead sync's
temporary file goes; a module source with tofu state, or none, is refused. Usage: sync_module_test.py
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SYNC = Path(__file__).resolve().parents[2] / "role/files/sync-module"
failures = []


def check(what, cond, detail=""):
    if cond:
        print(f"ok   {what}")
    else:
        failures.append(what)
        print(f"FAIL {what} {detail}", file=sys.stderr)


def sync(src, dst):
    return subprocess.run(["sh", str(SYNC), str(src), str(dst)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)


def tree(root):
    """rel path -> (kind, content or link target, executable)"""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p), False)
            elif p.is_dir():
                out[rel] = ("dir", None, False)
            else:
                out[rel] = ("file", p.read_bytes(), os.access(p, os.X_OK))
    return out


def pin(root, side):
    """Hard-links every file and symbolic link under root into side (so that no inode of theirs is
    reused while the links exist); returns a function that tells which of them root still holds."""
    side.mkdir()
    pinned = {}
    for n, (rel, (kind, _, _)) in enumerate(tree(root).items()):
        if kind != "dir":
            os.link(Path(root) / rel, side / str(n), follow_symlinks=False)
            pinned[rel] = side / str(n)

    def kept():
        return {rel for rel, p in pinned.items()
                if os.path.lexists(Path(root) / rel)
                and os.lstat(Path(root) / rel).st_ino == os.lstat(p).st_ino}
    return set(pinned), kept


def main():
    with tempfile.TemporaryDirectory() as t:
        t = Path(t)
        src, dst = t / "module", t / "tofu"
        (src / "modules/vm").mkdir(parents=True)
        (src / "main.tf").write_text('module "vm" { source = "./modules/vm" }\n')
        (src / "modules/vm/main.tf").write_text("# vm\n")
        (src / "vm.sh").write_text("#!/bin/sh\n")
        (src / "vm.sh").chmod(0o755)
        (src / ".hidden.tf").write_text("# hidden\n")
        (src / "gone.tf").write_text("# leaves the source later\n")
        (src / "link.tf").symlink_to("main.tf")
        # What tofu wrote into the working copy before (a cycle's state, a slot's workspace).
        (dst / "terraform.tfstate.d/slot-2").mkdir(parents=True)
        (dst / "terraform.tfstate.d/slot-2/terraform.tfstate").write_text("slot 2's state\n")
        (dst / "terraform.tfstate").write_text("slot 1's state\n")
        (dst / ".terraform").mkdir()
        (dst / ".terraform/plugin").write_text("x\n")
        (dst / ".terraform.lock.hcl").write_text("tofu's lock\n")
        (dst / "stale.tf").write_text("# an old module file\n")
        owned = {
            "terraform.tfstate": ("file", b"slot 1's state\n", False),
            "terraform.tfstate.d/slot-2/terraform.tfstate": ("file", b"slot 2's state\n", False),
            ".terraform/plugin": ("file", b"x\n", False),
            ".terraform.lock.hcl": ("file", b"tofu's lock\n", False),
        }

        def copy_ok(what):
            tofus = ("terraform.tfstate", "terraform.tfstate.d", ".terraform", ".terraform.lock.hcl")
            got = tree(dst)
            want = {k: v for k, v in tree(src).items() if k != ".terraform.lock.hcl"}
            module = {k: v for k, v in got.items() if k.split("/")[0] not in tofus}
            check(f"{what}: the working copy is the module", module == want, f"\n got {module}\nwant {want}")
            check(f"{what}: what tofu wrote is kept", all(got.get(k) == v for k, v in owned.items()), str(got))

        r = sync(src, dst)
        check("first sync succeeds", r.returncode == 0, r.stderr)
        copy_ok("first sync")
        check("an old file is removed", not (dst / "stale.tf").exists())

        files, kept = pin(dst, t / "pin1")
        r = sync(src, dst)
        check("second sync succeeds", r.returncode == 0, r.stderr)
        copy_ok("second sync")
        check("an unchanged module rewrites nothing (every file is the one it was)", kept() == files,
              str(files - kept()))

        (src / "main.tf").write_text('module "vm" { source = "./modules/vm" }\n# changed\n')
        (src / "gone.tf").unlink()
        (src / "vm.sh").chmod(0o644)
        (src / "modules/vm/extra.tf").write_text("# new\n")
        (src / "link.tf").unlink()
        (src / "link.tf").symlink_to("modules/vm/main.tf")
        (src / "lock").mkdir()
        (src / ".terraform.lock.hcl").write_text("the module's own lock\n")
        owned[".terraform.lock.hcl"] = ("file", b"the module's own lock\n", False)
        files, kept = pin(dst, t / "pin2")
        r = sync(src, dst)
        check("sync of a changed module succeeds", r.returncode == 0, r.stderr)
        copy_ok("changed module")
        check("exactly the changed files are replaced (new files, not rewritten in place)",
              files - kept() == {"main.tf", "vm.sh", "link.tf", "gone.tf", ".terraform.lock.hcl"},
              str(files - kept()))
        check("a file that left the module is removed", not (dst / "gone.tf").exists())
        check("no temporary file is left", not [p for p in tree(dst) if ".sync-module." in p], str(tree(dst)))

        (src / "main.tf").unlink()
        (src / "main.tf").mkdir()
        (src / "main.tf/inner.tf").write_text("# a directory now\n")
        r = sync(src, dst)
        check("a file that became a directory follows", r.returncode == 0 and (dst / "main.tf/inner.tf").is_file(), r.stderr)
        copy_ok("file to directory")

        junk = dst / "modules/old.tf.sync-module.999999999"
        junk.write_text("left by a sync that died\n")
        r = sync(src, dst)
        check("a dead sync's temporary file is removed", r.returncode == 0 and not junk.exists(), r.stderr)

        for state in ("terraform.tfstate", "terraform.tfstate.d", ".terraform"):
            bad = t / f"bad-{state}"
            bad.mkdir()
            (bad / "main.tf").write_text("#\n")
            (bad / state).mkdir() if state != "terraform.tfstate" else (bad / state).write_text("{}\n")
            r = sync(bad, dst)
            check(f"a module source with {state} is refused", r.returncode == 1 and
                  "would overwrite the pool's own tofu state" in r.stderr, r.stderr)
        r = sync(t / "missing", dst)
        check("a missing module source is refused", r.returncode == 1 and "is missing" in r.stderr, r.stderr)

    print(f"sync-module: {len(failures)} failed" if failures else "sync-module: every check passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
