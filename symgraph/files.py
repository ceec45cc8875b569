"""Output files and folders that are whole or absent: never half-written, never half-replaced, never an input.

Every output is first written to a hidden temporary sibling named ``.NAME.tmp-<pid>-<random>`` and renamed into
place. A folder that replaces an existing one is swapped in with one atomic exchange (Linux ``renameat2``), so
OUT always holds the old or the new folder. Where that call is missing, the old folder is first moved to
``.NAME.old-<pid>-<random>`` and the next run to the same output puts it back if the process died in between.
A run that was killed leaves its temporary siblings behind; the next run to the same output removes those whose
process is gone (a SIGINT or SIGTERM, which the CLI turns into an exception, removes them at once).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import uuid
from pathlib import Path

from .errors import OutputError

__all__ = ["refuse_overlap", "prepare_output", "temp_sibling", "install_folder", "write_atomic",
           "write_text_atomic", "StagedText", "clean_leftovers", "os_errors_as_output_error"]

_TMP, _OLD = "tmp", "old"


def refuse_overlap(output, inputs, *, folder: bool = True) -> None:
    """Raise :class:`OutputError` when writing ``output`` would change an input: a model folder that is, contains or
    lies inside an input's folder, or a file (``folder=False``) that is an input file, any file already in an input's
    folder (its model card, licence or code, which the rename would replace) or one of the files a model folder is
    read from (config, weights, tokenizer). Inputs that are not existing paths (modules, factory strings) are
    skipped."""
    from .io import MODEL_FILES

    out = _absolute(output)
    for source in inputs:
        if not isinstance(source, (str, os.PathLike)) or not Path(source).expanduser().exists():
            continue
        src = _absolute(source)
        for home in _homes(src):
            if folder:
                clash = out in (src, home) or home in out.parents or out in home.parents
            else:  # a file of the input's folder, or one a model folder is read from (a shard to come)
                clash = out == src or home in out.parents and (out.exists() or out.parent == home and (
                    out.name in MODEL_FILES or out.suffix in (".safetensors", ".bin")))
            if clash and not folder and out != src and out.exists():
                raise OutputError(
                    f"The output '{output}' would replace the file '{out.name}' already in the input folder "
                    f"'{home}' (a model card, licence, code or an earlier output: symgraph cannot tell which).",
                    hint="write to a new file name or outside the input folder, or move the existing file first.")
            if clash:
                relation = "is" if out in (src, home) else "lies inside" if home in out.parents else "contains"
                linked = "" if home in (src, src.parent) else f" (its files are links into '{home}')"
                raise OutputError(
                    f"The output '{output}' {relation} the input '{source}'{linked}: writing it would change or "
                    "replace an input.",
                    hint="choose an output path outside every input folder.")


def _homes(src: Path) -> list[Path]:
    """The folders an input's files live in: its own, and those its symbolic links point into (a folder of links
    to shards kept elsewhere, as the Hugging Face cache keeps them: replacing those replaces the input)."""
    home = src if src.is_dir() else src.parent
    linked = [Path(os.path.realpath(p)).parent for p in home.iterdir() if p.is_symlink()] if src.is_dir() else []
    return list(dict.fromkeys([home, *linked]))


def _absolute(path) -> Path:
    """The path with symbolic links resolved (a link to an input is that input), even if it does not exist."""
    return Path(os.path.realpath(Path(path).expanduser()))


def prepare_output(out: Path, *, overwrite: bool, folder: bool) -> None:
    """Check ``out`` can be (re)placed, after cleaning what interrupted runs to it left behind."""
    if not out.name:
        raise OutputError(f"The output path '{out}' names no file or folder.", hint="give a name, e.g. -o out/model.")
    clean_leftovers(out)
    blocker = next((p for p in out.parents if p.exists()), None)
    if blocker is not None and not blocker.is_dir():  # the OS says only "File exists" when creating the folders
        raise OutputError(f"Cannot write '{out}': '{blocker}' is a file, so no folder can be made inside it.",
                          hint="choose an output path whose folders are folders (or do not exist yet).")
    if out.is_symlink():
        raise OutputError(
            f"The output path '{out}' is a symbolic link (to '{os.readlink(out)}'); symgraph does not replace "
            "links.", hint="pass the path the link points to, or another output path.")
    if not out.exists():
        return
    kind = _kind(out)
    if folder and kind != "folder" or not folder and kind != "file":
        raise OutputError(f"The output path '{out}' exists and is a {kind}; refusing to replace it with a "
                          f"{'folder' if folder else 'file'}.", hint="choose another output path.")
    if folder and not overwrite:
        raise OutputError(f"Output folder '{out}' already exists.",
                          hint="pass --overwrite (overwrite=True) to replace it, or choose another output path.")
    if folder:
        _check_model_folder(out)


def _check_model_folder(out: Path) -> None:
    """--overwrite replaces a model folder (or an empty one), never a folder of other things: a mistyped -o such as
    a project or home folder would otherwise be deleted whole, and a model folder that also holds what a written one
    does not carry (a model card, training checkpoints, notes) would lose those."""
    import json

    from .checkpoint import not_carried_over
    from .io import WEIGHT_FILES

    entries = sorted(p.name + "/" * p.is_dir() for p in out.iterdir())
    if not entries:
        return
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    is_model = (isinstance(config, dict) and ("model_type" in config or "architectures" in config)
                or any(n in WEIGHT_FILES or n.endswith(".safetensors") for n in entries))
    if not is_model:
        raise OutputError(
            f"Output folder '{out}' holds no model (no Hugging Face config.json or weights; it holds "
            f"{', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}): --overwrite replaces model folders only, "
            "and replacing this one would delete everything in it.",
            hint="choose another output path (a new folder, or an earlier model output), or empty this folder "
                 "yourself.")
    other = [n for n in entries if n.startswith(".")] + not_carried_over(out)  # .git of a cloned repository too
    if other:
        raise OutputError(
            f"Output folder '{out}' holds a model and also {', '.join(other[:5])}{', ...' if len(other) > 5 else ''}, "
            "which the written model does not carry: --overwrite would delete them.",
            hint="move them out of the folder first, or choose another output path.")


def _kind(path: Path) -> str:
    mode = path.lstat().st_mode
    return "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "device, pipe or socket"


def temp_sibling(out: Path) -> Path:
    """A new name for a hidden temporary sibling of ``out`` (nothing is created: the caller makes it inside the
    block that removes it, so that an interrupt in between leaves nothing)."""
    return out.parent / f".{out.name}.{_TMP}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def clean_leftovers(out: Path) -> None:
    """Undo what runs to ``out`` that died left behind: put a moved-away old folder back when ``out`` is missing,
    and remove temporary siblings whose process is gone. Best effort: a leftover that cannot be removed stays."""
    parent = out.parent if out.parent.is_dir() else None
    if parent is None or not out.name:
        return
    for path in sorted(parent.glob(f".{_glob_escape(out.name)}.*-*-*")):
        kind, pid = _leftover(path, out.name)
        if kind is None or _alive(pid):
            continue
        try:
            if kind == _OLD and not out.exists() and not out.is_symlink():
                os.rename(path, out)  # the replacement died between its two renames: the old folder comes back
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError:
            pass


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def _leftover(path: Path, name: str) -> tuple[str | None, int]:
    rest = path.name[len(name) + 2:] if path.name.startswith(f".{name}.") else ""
    kind, _, tail = rest.partition("-")
    pid = tail.partition("-")[0]
    return (kind, int(pid)) if kind in (_TMP, _OLD) and pid.isdigit() else (None, 0)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own earlier attempt, now abandoned
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def install_folder(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Move the finished folder ``tmp`` to ``out``; with ``overwrite`` replace an existing ``out`` so that a
    crash at any moment leaves the old or the new folder at ``out`` (or, at worst, one the next run restores)."""
    if not out.exists():
        os.rename(tmp, out)  # atomic; fails if someone created a non-empty out meanwhile
        return
    if not overwrite:  # appeared while we were writing
        raise OutputError(f"Output folder '{out}' appeared while the model was being written.",
                          hint="pass --overwrite (overwrite=True) to replace it, or choose another output path.")
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old folder
        return
    old = out.parent / f".{out.name}.{_OLD}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # put the original back before reporting
        raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False  # kernel or file system without exchange: fall back to two renames
    raise OSError(code, os.strerror(code), str(b))


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary sibling and a rename, so no half-written file is left."""
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def write_atomic(path, write) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it into place: readers see the old file
    or the whole new one, never half of it. OS errors become :class:`OutputError`."""
    staged = StagedText(path, write)
    staged.commit()
    return staged.path


class StagedText:
    """A file written now under a temporary name and renamed into place by :meth:`commit`: side files (``--stats``,
    ``--json``) are staged before the model folder is written, so a side file that cannot be written stops the
    run before anything is in place, and committing after the model is only a rename.

    A symbolic link is written through (the file it points to is replaced, the link stays); a pipe or character
    device (``/dev/stdout``, a shell's ``>(...)``) is written directly at :meth:`commit`, never replaced."""

    def __init__(self, path, write):
        self.path = Path(path)
        self._write, self._tmp = write, None
        if _is_stream(self.path):  # as given: /dev/stdout resolves to a name that cannot be opened again
            return
        if self.path.is_symlink():
            self.path = Path(os.path.realpath(self.path))
        if not self.path.parent.is_dir():
            raise OutputError(f"Cannot write '{self.path}': folder '{self.path.parent}' does not exist"
                              f"{' (it is a file)' if self.path.parent.exists() else ''}.",
                              hint="create the folder first, or choose another output path.")
        prepare_output(self.path, overwrite=True, folder=False)
        with os_errors_as_output_error(self.path):
            self._tmp = temp_sibling(self.path)
            try:
                write(self._tmp)
            except BaseException:
                self.discard()
                raise

    def commit(self, text: str | None = None) -> Path:
        """Rename the staged file into place, first rewriting it with ``text`` when given (its folder is known
        to be writable by now); a stream gets its content now."""
        with os_errors_as_output_error(self.path):
            if self._tmp is None:  # a pipe or device
                self.path.write_text(text) if text is not None else self._write(self.path)
                return self.path
            try:
                if text is not None:
                    self._tmp.write_text(text)
                os.replace(self._tmp, self.path)
            except BaseException:
                self.discard()
                raise
        return self.path

    def discard(self) -> None:
        if self._tmp is None:
            return
        try:
            self._tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the next run to this path removes it


def _is_stream(path: Path) -> bool:
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)


@contextlib.contextmanager
def os_errors_as_output_error(path: Path):
    """Report a failed write (read-only file system, permissions, full disk) as bad output, naming ``path``."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"Cannot write '{path}': {exc.strerror or exc}.",
                          hint="check that the folder is writable (not on a read-only file system) and the disk has "
                          "space, or choose another output path.") from exc
