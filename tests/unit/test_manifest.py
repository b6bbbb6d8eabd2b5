"""Manifest JSON round trip and validation; checksums; file verification for each corruption kind."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import xxhash

import peftckpt
from peftckpt.checkpoint.errors import CheckpointFormatError, CheckpointIntegrityError
from peftckpt.checkpoint.location.names import MANIFEST_FILENAME
from peftckpt.checkpoint.storage.checksums import (
    CHECKSUM_ALGORITHM,
    HASH_BLOCK_BYTES,
    ChecksummingFileSystem,
    checksum_file,
    checksum_files,
    verify_files,
)
from peftckpt.checkpoint.storage.manifest import FORMAT_VERSION, Manifest, read_manifest


def _manifest(**kw: object) -> Manifest:
    base: dict[str, object] = dict(
        format="torch_dist",
        iteration=100,
        sections=["model", "optimizer"],
        layout={"tp": 2, "pp": 1, "dp": 2, "vpp": 1},
        model_config={"hidden": 64, "layers": 2},
        trainable_only=True,
        saved_keys={"model.a.lora_A.weight": {"shape": [4, 64], "dtype": "float32", "requires_grad": True}},
        excluded_keys={"model.a.weight": {"shape": [64, 64], "dtype": "bfloat16", "requires_grad": False}},
        adapter_config={"r": 4, "alpha": 8.0},
        base_fingerprint="sha256:abc",
        args={"lr": 1e-3},
    )
    base.update(kw)
    return Manifest(**base)  # type: ignore[arg-type]


def _ckpt(tmp_path: Path) -> tuple[Path, Manifest]:
    ckpt = tmp_path / "iter_0000100"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 10)
    (ckpt / "sub" / "x.bin").write_bytes(b"hello")
    (ckpt / ".metadata").write_bytes(b"md")
    files = checksum_files([ckpt / "__0_0.distcp", Path("sub/x.bin"), ckpt / ".metadata"], ckpt)
    manifest = _manifest(files=files)
    (ckpt / MANIFEST_FILENAME).write_bytes(manifest.to_json())
    return ckpt, manifest


def test_defaults_and_round_trip(tmp_path: Path) -> None:
    m = _manifest(files={"a": {"size": 1, "checksum": "00"}})
    assert m.format_version == FORMAT_VERSION == 1
    assert m.library_version == peftckpt.__version__
    assert m.checksum_algorithm == CHECKSUM_ALGORITHM == "xxh3_128"
    data = m.to_json()
    assert data == m.to_json()  # stable
    assert list(json.loads(data)) == sorted(json.loads(data))  # sorted keys
    assert Manifest.from_json(data, tmp_path / "m.json") == m
    (tmp_path / MANIFEST_FILENAME).write_bytes(data)
    assert read_manifest(tmp_path) == m


def _reference_json(m: Manifest) -> bytes:
    """The manifest's text as defined: sorted fields a line each, a string-keyed mapping an entry per line, and
    ``manifest_sha256`` of the canonical ``json.dumps(sort_keys=True)`` of the rest."""
    from dataclasses import asdict

    body = asdict(m)
    body["manifest_sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()

    def field(key: str, v: object) -> str:
        if isinstance(v, dict) and v and all(isinstance(k, str) for k in v):
            entries = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v[k], sort_keys=True)}" for k in sorted(v))
            return f"  {json.dumps(key)}: {{\n{entries}\n  }}"
        return f"  {json.dumps(key)}: {json.dumps(v, sort_keys=True)}"

    return ("{\n" + ",\n".join(field(k, body[k]) for k in sorted(body)) + "\n}\n").encode()


def test_large_key_records_are_encoded_once_per_change(tmp_path: Path) -> None:
    """A run's saves record the same few thousand key records: their text is reused while they are equal, and
    written afresh the moment one record differs (same count), the manifest always its defined text."""
    records = {f"model.layers.{i}.w": {"shape": [i + 1, 8], "dtype": "float32", "requires_grad": i % 2 == 0}
               for i in range(300)}
    first = _manifest(saved_keys=records, excluded_keys=dict(records), created_at="t")
    assert first.to_json() == _reference_json(first)
    again = _manifest(saved_keys={k: dict(v) for k, v in records.items()}, excluded_keys=dict(records), created_at="t")
    assert again.to_json() == first.to_json()  # (equal values: the reused text)
    changed = {k: dict(v) for k, v in records.items()}
    changed["model.layers.7.w"]["requires_grad"] = True
    changed["model.layers.9.w"]["shape"] = [10, 9]
    other = _manifest(saved_keys=changed, excluded_keys=dict(records), created_at="t")
    assert other.to_json() == _reference_json(other) != first.to_json()
    assert Manifest.from_json(other.to_json(), tmp_path / "m.json") == other
    records["model.layers.0.w"]["dtype"] = "bfloat16"  # the caller's dict changed after a save: not the copy
    assert _manifest(saved_keys=records, created_at="t").to_json() == _reference_json(
        _manifest(saved_keys=records, created_at="t"))


def test_newer_format_version_error_text(tmp_path: Path) -> None:
    raw = json.loads(_manifest().to_json())
    raw["format_version"] = 2
    raw["some_future_field"] = 1
    src = tmp_path / "iter_0000100" / MANIFEST_FILENAME
    with pytest.raises(CheckpointFormatError) as exc:
        Manifest.from_json(json.dumps(raw).encode(), src)
    assert str(exc.value) == (
        f"checkpoint {src} has format version 2 but this peftckpt ({peftckpt.__version__}) reads up to 1; "
        f"upgrade peftckpt"
    )


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda r: r.pop("iteration"), "missing field.s. iteration"),
        (lambda r: r.update(format="safetensors"), "unknown format 'safetensors'"),
        (lambda r: r.update(iteration="100"), "field 'iteration' must be an int >= 0, got '100'"),
        (lambda r: r.update(trainable_only=1), "field 'trainable_only' must be a bool"),
        (lambda r: r.update(layout={"tp": "2"}), "field 'layout' must be an object of ints"),
        (lambda r: r["saved_keys"].update(k={"shape": [2]}), r"saved_keys\['k'\] must be"),
        (lambda r: r.update(files={"a": {"size": -1, "checksum": "x"}}), r"files\['a'\] must be"),
        (lambda r: r.update(files={"../a": {"size": 1, "checksum": "x"}}),
         r"files\['../a'\] must name a file inside the checkpoint .*'\.\.' component"),
        (lambda r: r.update(files={"": {"size": 1, "checksum": "x"}}), r"files\[''\] must name .*is empty"),
        (lambda r: r.update(files={".": {"size": 1, "checksum": "x"}}), r"files\['\.'\] must name"),
        (lambda r: r.update(files={"/etc/passwd": {"size": 1, "checksum": "x"}}), "is an absolute path"),
        (lambda r: r.update(files={"metadata.json": {"size": 1, "checksum": "x"}}), "is the manifest"),
    ],
)
def test_malformed_fields_are_named(tmp_path: Path, mutate: object, expected: str) -> None:
    raw = json.loads(_manifest().to_json())
    raw.pop("manifest_sha256")  # a hand-edited manifest without its self-checksum: field checks apply
    mutate(raw)  # type: ignore[operator]
    with pytest.raises(
        CheckpointFormatError, match=f"manifest {tmp_path / 'm.json'} is malformed: .*{expected}"
    ):
        Manifest.from_json(json.dumps(raw).encode(), tmp_path / "m.json")


def test_bad_json_and_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match=f"manifest {tmp_path / 'm.json'} is not valid JSON"):
        Manifest.from_json(b"{not json", tmp_path / "m.json")
    with pytest.raises(CheckpointFormatError, match="must hold a JSON object, got list"):
        Manifest.from_json(b"[]", tmp_path / "m.json")
    with pytest.raises(CheckpointFormatError, match=f"{tmp_path} is not a committed peftckpt checkpoint"):
        read_manifest(tmp_path)


def test_checksum_matches_xxh3_and_hashlib_across_blocks(tmp_path: Path) -> None:
    data = bytes(range(256)) * (HASH_BLOCK_BYTES // 256) + b"tail"  # spans two blocks
    f = tmp_path / "big"
    f.write_bytes(data)
    assert checksum_file(f) == xxhash.xxh3_128(data).hexdigest()
    assert checksum_files([f], tmp_path) == {
        "big": {"size": len(data), "checksum": xxhash.xxh3_128(data).hexdigest()}
    }
    assert checksum_file(f, "sha256") == hashlib.sha256(data).hexdigest()
    assert checksum_files([], tmp_path) == {}


def test_checksums_taken_while_writing_equal_a_read_back(tmp_path: Path) -> None:
    fs = ChecksummingFileSystem()
    chunks = [b"x" * 10, memoryview(bytes(range(256)) * 4), bytearray(b"tail")]
    with fs.create_stream(tmp_path / "a.tmp", "wb") as stream:
        for chunk in chunks:
            stream.write(chunk)
    fs.rename(tmp_path / "a.tmp", tmp_path / "a")  # DCP writes .metadata this way
    (tmp_path / "b").write_bytes(b"written elsewhere")  # not seen: hashed from disk
    with fs.create_stream(tmp_path / "c", "wb") as stream:
        stream.write(b"seen")
    (tmp_path / "c").write_bytes(b"changed after")  # the size differs from what was seen: hashed afresh
    assert fs.checksums([tmp_path / "a", Path("b"), tmp_path / "c"], tmp_path) == \
        checksum_files([tmp_path / "a", tmp_path / "b", tmp_path / "c"], tmp_path)


def test_intact_checkpoint_verifies(tmp_path: Path) -> None:
    ckpt, manifest = _ckpt(tmp_path)
    assert sorted(manifest.files) == [".metadata", "__0_0.distcp", "sub/x.bin"]
    assert verify_files(ckpt, manifest) == []


def test_truncated_file(tmp_path: Path) -> None:
    ckpt, manifest = _ckpt(tmp_path)
    (ckpt / "__0_0.distcp").write_bytes(b"short")
    assert verify_files(ckpt, manifest) == [
        f"{ckpt / '__0_0.distcp'}: size mismatch (truncated): expected 2560 bytes, got 5"
    ]


def test_extended_file(tmp_path: Path) -> None:
    ckpt, manifest = _ckpt(tmp_path)
    with open(ckpt / "sub" / "x.bin", "ab") as f:
        f.write(b"!")
    assert verify_files(ckpt, manifest) == [
        f"{ckpt / 'sub' / 'x.bin'}: size mismatch (extended): expected 5 bytes, got 6"
    ]


def test_flipped_byte(tmp_path: Path) -> None:
    ckpt, manifest = _ckpt(tmp_path)
    path = ckpt / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[1000] ^= 0x01
    path.write_bytes(bytes(data))
    problems = verify_files(ckpt, manifest)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"{path}: xxh3_128 checksum mismatch: expected {manifest.files['__0_0.distcp']['checksum']}"
    )


def test_a_sha256_manifest_still_verifies(tmp_path: Path) -> None:
    ckpt, manifest = _ckpt(tmp_path)
    files = checksum_files([ckpt / p for p in manifest.files], ckpt, "sha256")
    old = _manifest(files=files, checksum_algorithm="sha256")
    assert verify_files(ckpt, old) == []
    (ckpt / "sub" / "x.bin").write_bytes(b"HELLO")
    assert verify_files(ckpt, old)[0].startswith(f"{ckpt / 'sub' / 'x.bin'}: sha256 checksum mismatch")


def test_unknown_checksum_algorithm(tmp_path: Path) -> None:
    ckpt, manifest = _ckpt(tmp_path)
    assert verify_files(ckpt, _manifest(files=manifest.files, checksum_algorithm="crc99")) == [
        f"{ckpt}: unknown checksum algorithm 'crc99'"]


def test_deleted_and_extra_files(tmp_path: Path) -> None:
    ckpt, manifest = _ckpt(tmp_path)
    (ckpt / ".metadata").unlink()
    (ckpt / "sub" / "stray.tmp").write_bytes(b"?")
    assert verify_files(ckpt, manifest) == [
        f"{ckpt / '.metadata'}: missing (expected 2 bytes)",
        f"{ckpt / 'sub' / 'stray.tmp'}: unexpected file, not listed in the manifest",
    ]


def test_damaged_manifest_is_detected_by_its_self_checksum(tmp_path: Path) -> None:
    data = _manifest().to_json()
    assert Manifest.from_json(data, tmp_path / "m.json").iteration == json.loads(data)["iteration"]
    raw = json.loads(data)
    raw["iteration"] += 1  # still valid JSON, still well-formed: only the self-checksum can tell
    with pytest.raises(CheckpointIntegrityError, match=f"manifest {tmp_path / 'm.json'} is damaged"):
        Manifest.from_json(json.dumps(raw).encode(), tmp_path / "m.json")
