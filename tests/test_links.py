"""No link is followed: a checkpoint, an archive or a study design that is, or holds, a
symbolic link (or a pipe, a device, a folder) is refused with the file named, even with a
recomputed manifest; a writer never writes through a planted link; written files get the
umask's mode. Each probe has a clean twin that must work. Cheap: tiny models, no training."""

import os
import stat

import pytest
import torch

from workbook import WorkbookError
from workbook.storage.artifacts import (
    read_json,
    reseal,
    verify,
    verify_file,
    write_file,
    write_folder,
)
from workbook.storage.runs import seal_file
from workbook.training.checkpoint import load_checkpoint, load_state, save_checkpoint


def _checkpoint(tmp_path, name="ckpt"):
    model = torch.nn.Linear(4, 3)
    return save_checkpoint(tmp_path / name, model, torch.optim.AdamW(model.parameters()),
                           counters={"step": 1})


def _secret(tmp_path):
    """A file outside every folder under test: what a planted link reaches for."""
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    secret = outside / "secret.safetensors"
    from safetensors.torch import save_model

    save_model(torch.nn.Linear(4, 3), str(secret))  # loadable: only the link refusal stops it
    return secret


def _load(path):
    return lambda: load_checkpoint(path, torch.nn.Linear(4, 3))


def _refused(call, *words):
    with pytest.raises(WorkbookError) as info:
        call()
    for w in words:
        assert w in str(info.value), str(info.value)
    return info.value


# --- reading -------------------------------------------------------------------------------
def test_a_weight_file_linked_outside_is_refused_even_with_a_recomputed_manifest(tmp_path):
    """Seen: the link was followed and the file outside the checkpoint loaded."""
    path, secret = _checkpoint(tmp_path), _secret(tmp_path)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").symlink_to(secret)
    reseal(path)  # anyone who can write the folder can
    error = _refused(_load(path), f"checkpoint {path}: model.safetensors is a symbolic link "
                                  f"(to {secret})")
    assert error.fix == ("a checkpoint holds plain files only - copy the real file in, or use an "
                         "intact checkpoint")


@pytest.mark.parametrize("name, target", [
    ("state.pt", "model.safetensors"),  # a link inside the folder is a link too
    ("meta.json", "/dev/zero"),  # would never end
    ("manifest.json", "../outside/manifest.json"),
])
def test_any_linked_file_of_a_checkpoint_is_refused(name, target, tmp_path):
    path = _checkpoint(tmp_path)
    (tmp_path / "outside").mkdir()
    os.replace(path / name, tmp_path / "outside" / name)
    (path / name).symlink_to(target)
    if name == "state.pt":
        reseal(path)  # the forger's manifest lists the link (a /dev/zero link cannot be hashed)
    _refused(lambda: load_state(path), f"{name} is a symbolic link (to {target})")


def test_an_unlisted_link_a_pipe_and_a_folder_in_a_checkpoint_are_refused(tmp_path):
    path = _checkpoint(tmp_path)
    (path / "extra").symlink_to("/etc/passwd")
    _refused(lambda: load_state(path), "extra is a symbolic link (to /etc/passwd)")
    (path / "extra").unlink()
    os.mkfifo(path / "extra")  # reading it would wait forever for a writer
    _refused(lambda: load_state(path), "extra is a named pipe")
    (path / "extra").unlink()
    (path / "extra").mkdir()
    _refused(lambda: load_state(path), "extra is a folder")
    (path / "extra").rmdir()
    assert load_state(path)["counters"] == {"step": 1}, "clean twin: intact, it loads"


def test_a_listed_file_replaced_by_a_pipe_is_refused_without_waiting(tmp_path):
    path = _checkpoint(tmp_path)
    (path / "state.pt").unlink()
    os.mkfifo(path / "state.pt")
    _refused(lambda: load_state(path), "state.pt is a named pipe")


def test_a_linked_checkpoint_folder_is_refused_and_the_real_one_loads(tmp_path):
    path = _checkpoint(tmp_path)
    (tmp_path / "latest").symlink_to(path)
    error = _refused(_load(tmp_path / "latest"), f"checkpoint {tmp_path / 'latest'} is a "
                                                 f"symbolic link (to {path})")
    assert error.fix.startswith("a checkpoint is a plain folder, never a link - name the real "
                                "folder if you trust it")
    assert _load(path)()["counters"] == {"step": 1}


def test_an_archive_holding_a_link_is_refused(tmp_path):
    def fill(tmp):
        (tmp / "config.json").write_text("{}")
        (tmp / "metrics.csv").write_text("x\n1\n")

    path = write_folder(tmp_path / "archive", fill, "archive")
    assert set(verify(path, "archive")) == {"config.json", "metrics.csv"}
    (path / "config.json").unlink()
    (path / "config.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text("{}")
    reseal(path)
    _refused(lambda: verify(path, "archive"), "archive", "config.json is a symbolic link",
             "an archive holds plain files only")


def test_read_json_never_follows_a_link(tmp_path):
    (tmp_path / "real.json").write_text('{"a": 1}')
    assert read_json(tmp_path / "real.json") == {"a": 1}
    (tmp_path / "meta.json").symlink_to(tmp_path / "real.json")
    _refused(lambda: read_json(tmp_path / "meta.json", "checkpoint meta"),
             "checkpoint meta", "meta.json is a symbolic link")


def test_a_study_design_linked_or_in_a_linked_folder_is_refused(tmp_path):
    folder = tmp_path / "study"
    folder.mkdir()
    design = folder / "design.json"
    design.write_text('{"name": "s"}')
    seal_file(design)
    verify_file(design, "study design")  # clean twin
    (tmp_path / "alias").symlink_to(folder)
    _refused(lambda: verify_file(tmp_path / "alias" / "design.json", "study design"),
             "the folder of the study design", "alias is a symbolic link")
    os.replace(design, tmp_path / "design.json")
    design.symlink_to(tmp_path / "design.json")
    seal_file(tmp_path / "design.json")
    os.replace(tmp_path / "design.json.manifest.json", folder / "design.json.manifest.json")
    _refused(lambda: verify_file(design, "study design"), "design.json is a symbolic link")


def test_hard_links_are_accepted_but_a_change_through_the_other_name_is_caught(tmp_path):
    """The decision (see artifacts): st_nlink > 1 is what backups by hard link and dedup tools
    leave, so it is no alarm; the digest still catches any change made through the other name."""
    path = _checkpoint(tmp_path)
    os.link(path / "state.pt", tmp_path / "backup-state.pt")
    assert load_state(path)["counters"] == {"step": 1}
    with open(tmp_path / "backup-state.pt", "r+b") as other:
        other.seek(-1, os.SEEK_END)
        last = other.read(1)
        other.seek(-1, os.SEEK_END)
        other.write(bytes([last[0] ^ 0xFF]))
    _refused(lambda: load_state(path), "state.pt does not match its manifest")


# --- writing -------------------------------------------------------------------------------
def test_a_writer_refuses_links_its_fill_makes_and_copies_hard_linked_files(tmp_path):
    secret = _secret(tmp_path)

    def linked(tmp):
        (tmp / "model.safetensors").symlink_to(secret)

    _refused(lambda: write_folder(tmp_path / "c", linked, "checkpoint"),
             "holds model.safetensors, which is a symbolic link")
    assert not (tmp_path / "c").exists() and not list(tmp_path.glob(".c.partial*"))

    def hard(tmp):
        os.link(secret, tmp / "model.safetensors")

    path = write_folder(tmp_path / "h", hard, "checkpoint")
    assert (path / "model.safetensors").stat().st_nlink == 1, "an inode of its own"
    assert secret.stat().st_nlink == 1


def test_a_planted_link_at_the_destination_is_never_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "ckpt").symlink_to(tmp_path / "nowhere")  # dangling: exists() says no
    _refused(lambda: _checkpoint(tmp_path), "checkpoint", "ckpt already exists (a symbolic link")
    (tmp_path / "w.bin").symlink_to(victim)
    _refused(lambda: write_file(tmp_path / "w.bin", lambda t: t.write_bytes(b"x"), "weights"),
             "weights", "w.bin already exists (a symbolic link")
    # the temporary name a writer once used, predictable from the pid, planted as a link
    (tmp_path / f".x.bin.partial-{os.getpid()}").symlink_to(victim)
    write_file(tmp_path / "x.bin", lambda t: t.write_bytes(b"mine"), "weights")
    assert victim.read_text() == "precious" and (tmp_path / "x.bin").read_bytes() == b"mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x.bin.partial-") and
                not p.is_symlink()]


def test_write_file_never_overwrites(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"theirs")
    _refused(lambda: write_file(tmp_path / "w.bin", lambda t: t.write_bytes(b"x"), "weights"),
             "weights", "already exists")
    assert (tmp_path / "w.bin").read_bytes() == b"theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin"]


@pytest.mark.parametrize("mask, file_mode, folder_mode", [(0o022, 0o644, 0o755),
                                                          (0o077, 0o600, 0o700)])
def test_written_files_get_the_umask_mode_whatever_safetensors_chose(mask, file_mode,
                                                                     folder_mode, tmp_path):
    """Seen: safetensors files in archives were 0600 beside 0644 JSON: another account could
    not reload the archive."""
    from safetensors.torch import save_file

    before = os.umask(mask)
    try:
        path = _checkpoint(tmp_path)
        one = write_file(tmp_path / "w.safetensors",
                         lambda t: save_file({"w": torch.zeros(2)}, str(t)), "weights")
    finally:
        os.umask(before)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in [*path.iterdir(), one]}
    assert set(modes.values()) == {file_mode}, modes
    assert stat.S_IMODE(path.stat().st_mode) == folder_mode
