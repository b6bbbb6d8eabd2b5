"""A committed checkpoint's objects on a store, checked against its manifest while they stream.

:func:`read_remote_manifest` reads and validates the manifest object; :func:`fetch_files` downloads the recorded
objects into a local directory (or only reads them through, for ``verify``), hashing every block as it arrives,
and reports each missing, resized, damaged or unlisted object by its URL -- the same checks as
:func:`~peftckpt.checkpoint.storage.checksums.verify_files` on disk, without a second pass over the bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peftckpt.checkpoint.errors import CheckpointError, CheckpointFormatError
from peftckpt.checkpoint.location.names import MANIFEST_FILENAME
from peftckpt.checkpoint.storage.checksums import new_digest
from peftckpt.checkpoint.storage.manifest import MANIFEST_MAX_BYTES, Manifest
from peftckpt.checkpoint.storage.object_store import ObjectStore, store_error

__all__ = ["renamed_error", "read_remote_manifest", "read_listed", "list_checked", "listed_problems", "fetch_one", "fetch_files"]

_TRANSFER_THREADS = 8


def renamed_error(e: BaseException, local: Path, url: str) -> BaseException:
    """``e`` with the local copy's path in its message replaced by the URL it came from."""
    if isinstance(e, CheckpointError) and e.args and isinstance(e.args[0], str) and str(local) in e.args[0]:
        e.args = (e.args[0].replace(str(local), url), *e.args[1:])
    return e


def read_remote_manifest(store: ObjectStore, rel: str, data: bytes | None = None) -> tuple[Manifest, bytes]:
    """The manifest of the checkpoint ``rel`` of ``store`` (and its bytes; ``data``: the bytes, already read)."""
    where = f"{rel}/{MANIFEST_FILENAME}" if rel else MANIFEST_FILENAME
    url = store.url_of(where)
    try:
        data = store.read_bytes(where, MANIFEST_MAX_BYTES) if data is None else data
    except FileNotFoundError:
        raise CheckpointFormatError(f"{store.url_of(rel)} is not a committed peftckpt checkpoint: it has no "
                                    f"{MANIFEST_FILENAME}") from None
    except ValueError as e:
        raise CheckpointFormatError(f"manifest {url} cannot be read: it {e}") from None
    except Exception as e:  # noqa: BLE001 - the store's failure, named once
        raise store_error(e, url, "the manifest") from None
    return Manifest.from_json(data, url), data  # type: ignore[arg-type]


def read_listed(store: ObjectStore, rel: str, data: bytes | None = None
                ) -> tuple[Manifest, bytes, tuple[dict[str, int], dict[str, str]]]:
    """The manifest of the checkpoint ``rel`` (and its bytes) and :func:`list_checked`'s answer, the LIST sent
    while the manifest is read: two requests in the time of one (``data``: the manifest's bytes, already read)."""
    if data is not None:
        manifest, data = read_remote_manifest(store, rel, data)
        return manifest, data, list_checked(store, rel, manifest)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="peftckpt-list") as pool:
        listing = pool.submit(store.list_files, rel)
        manifest, data = read_remote_manifest(store, rel)
        return manifest, data, list_checked(store, rel, manifest, listing.result)


def fetch_one(store: ObjectStore, rel: str, name: str, expected: dict, algorithm: str, into: Path | None,
              listed: bool = False) -> str | None:
    """Stream the object ``name`` of checkpoint ``rel`` into ``into`` (``None``: only through the hash), checked
    against ``expected``'s ``size`` and ``checksum`` (``None``: a size alone); the problem, named by URL, or
    ``None``. ``listed``: a listing just found the object at that size (no HEAD is sent to ask for it)."""
    size = int(expected["size"]) if listed else None
    url = store.url_of(f"{rel}/{name}" if rel else name)
    digest = new_digest(algorithm)
    key = f"{rel}/{name}" if rel else name
    try:
        if into is None:
            got = store.read_through(key, digest.update, limit=int(expected["size"]), size=size)
        else:
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            got = store.download(key, into / name, digest.update, limit=int(expected["size"]), size=size)
    except ValueError:
        return f"{url}: size mismatch (extended): more than the {expected['size']} bytes recorded"
    except FileNotFoundError:
        return f"{url}: missing (expected {expected['size']} bytes)"
    except Exception as e:  # noqa: BLE001 - one line naming the object
        return f"{url}: cannot be read: {store_error(e, url, 'the object')}"
    if got != int(expected["size"]):
        return f"{url}: size mismatch (truncated): expected {expected['size']} bytes, got {got}"
    if expected["checksum"] is not None and digest.hexdigest() != expected["checksum"]:
        return (f"{url}: {algorithm} checksum mismatch: expected {expected['checksum']}, "
                f"got {digest.hexdigest()}")
    return None


def listed_problems(store: ObjectStore, rel: str, manifest: Manifest, stored: dict[str, int]) -> dict[str, str]:
    """``{name: problem}`` of the checkpoint ``rel`` from a listing of its objects (``stored``: name -> size): a
    recorded object missing or of another size, an object the manifest does not list."""
    problems: dict[str, str] = {}
    for name, rec in sorted(manifest.files.items()):
        size = stored.get(name)
        if size is None:
            problems[name] = f"{store.url_of(f'{rel}/{name}' if rel else name)}: missing (expected {rec['size']} bytes)"
        elif size != int(rec["size"]):
            kind = "truncated" if size < int(rec["size"]) else "extended"
            problems[name] = (f"{store.url_of(f'{rel}/{name}' if rel else name)}: size mismatch ({kind}): expected "
                              f"{rec['size']} bytes, got {size}")
    for name in sorted(set(stored) - set(manifest.files) - {MANIFEST_FILENAME}):
        problems[name] = f"{store.url_of(f'{rel}/{name}' if rel else name)}: unexpected object, not listed in the manifest"
    return problems


def list_checked(store: ObjectStore, rel: str, manifest: Manifest,
                 listing: Callable[[], dict[str, int]] | None = None) -> tuple[dict[str, int], dict[str, str]]:
    """One LIST of the checkpoint ``rel`` (``listing``: the answer of one already sent): ``({name: size},
    {name: problem})`` (:func:`listed_problems`); a listing that fails is one problem naming the checkpoint."""
    try:
        new_digest(manifest.checksum_algorithm)
        stored = listing() if listing is not None else store.list_files(rel)
    except CheckpointError as e:
        return {}, {"": f"{store.url_of(rel)}: {e}"}
    except Exception as e:  # noqa: BLE001
        raise store_error(e, store.url_of(rel), "the checkpoint") from None
    return stored, listed_problems(store, rel, manifest, stored)


def fetch_files(store: ObjectStore, rel: str, manifest: Manifest, into: Path | None,
                listed: tuple[dict[str, int], dict[str, str]] | None = None, only: Callable[[str], bool] | None = None
                ) -> list[str]:
    """Stream every object the manifest records for checkpoint ``rel`` (``only``: those it accepts) -- into the
    directory ``into``, or only through the hash when ``into`` is ``None`` -- and return one problem per bad object
    (empty: intact).

    Reported: a recorded object that is missing, of another size, or whose checksum differs, and an object
    below ``rel`` that the manifest does not list (``listed``: :func:`list_checked`'s answer, if already taken)."""
    _, problems = list_checked(store, rel, manifest) if listed is None else listed
    problems = dict(problems)
    if "" in problems:  # not listed at all
        return [problems[""]]
    to_fetch = [name for name in sorted(manifest.files) if name not in problems and (only is None or only(name))]
    if into is not None:
        into.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(1, min(_TRANSFER_THREADS, len(to_fetch)))) as pool:
        found = pool.map(lambda n: fetch_one(store, rel, n, manifest.files[n], manifest.checksum_algorithm, into,
                                             listed=True), to_fetch)  # (listed at the recorded size)
        for name, problem in zip(to_fetch, found):
            if problem is not None:
                problems[name] = problem
    return [problems[n] for n in sorted(problems)]
