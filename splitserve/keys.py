"""API keys hashed at rest, grouped by tenant, each tenant with optional rate limits.

The gateway's `--api-keys-file` (JSON or TOML, by the file's suffix; `.json` else TOML):

    [[tenants]]
    name = "acme"                       # letters, digits, '.', '_', '-' (max 64); metrics label
    requests_per_minute = 600           # optional: overrides --rate-limit-requests-per-minute
    tokens_per_minute = 200000          # optional: overrides --rate-limit-tokens-per-minute (0: none)
    keys = ["ss-k3x9q2m7w4ab$scrypt$16384$8$1$<salt>$<hash>"]

    {"tenants": [{"name": "acme", "requests_per_minute": 600, "keys": ["ss-k3x9q2m7w4ab$scrypt$..."]}]}

A key has an id: `ss-<id>_<secret>`, the id 12 lowercase letters or digits, the secret at
least 32 URL-safe base64 characters (`generate` makes 43). The id is not secret (it names
the entry, as a user name would); the secret is. Its entry carries the same id in front:
`ss-<id>$<hash>`, so a key's entry is found by one dictionary lookup and `grep ss-<id>` finds it
in the file. A `<hash>` is one of (salts and hashes in unpadded URL-safe base64):
  - `scrypt$N$r$p$<salt>$<hash>` (the default),
  - `pbkdf2_sha256$<iterations>$<salt>$<hash>`,
  - `sha256$<64 hex digits>` (unsalted: only for long random keys, e.g. from `generate`),
each over the whole key text, id included. Ids are unique across the file.

Checking a request's key: a key seen before is found in an in-memory cache keyed by an HMAC
of the key under a per-process random secret (one HMAC per request; the cache never holds
the key or its plain SHA-256). A key not seen before costs at most one slow hash: a key with
an id is hashed against the one entry of that id, and refused with no hashing at all when no
entry has it (such refusals are not cached: they cost less than the cache would). The key
text itself is never logged or stored; keys given in plain (`--api-keys`) are held as
SHA-256 digests, found by one lookup.

Entries without an id (`scrypt$...`, what `hash` printed before keys had ids) keep working:
a key that is not of the `ss-<id>_<secret>` form is hashed against every entry without an id,
each compared in constant time (`hmac.compare_digest`, no early exit), and the verdict cached.
They cannot be given an id without changing the key clients send (the entry is a one-way
hash), so refusing them would lock every client out at upgrade; instead the gateway logs
at start how to migrate: `generate` new keys, hand them out, remove the old entries. Until then
tokens without an id cost one hash per such entry, in a queue of their own (gateway/core.py),
so they can delay only the keys without an id. (An old `generate` key, `ss-` and 43
characters, is never taken for a key with an id: the id form is at least 45 characters after
`ss-`.)

`python -m splitserve.keys hash` reads a key on stdin (never from the command line, where
`ps` and shell history would keep it) and prints its entry (with the key's id when it has
one); `generate` makes a new random key with an id and its entry; `check FILE` validates a file.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import collections
import hashlib
import hmac
import json
import logging
import re
import secrets
import string
import sys
import threading
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

ALGORITHMS = ("scrypt", "pbkdf2_sha256", "sha256")
DEFAULT_ALGORITHM = "scrypt"
SCRYPT_DEFAULT = (1 << 14, 8, 1)  # N, r, p: 16 MiB, ~50 ms on a server core
PBKDF2_DEFAULT_ITERATIONS = 600_000  # OWASP 2023 for PBKDF2-HMAC-SHA256
SALT_BYTES = 16
DIGEST_BYTES = 32
# Bounds on what a file may ask the gateway to compute per unseen key.
MAX_SCRYPT_MEMORY = 256 << 20
PBKDF2_ITERATIONS_RANGE = (10_000, 10_000_000)
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
DEFAULT_TENANT = "default"  # the tenant of keys given in plain with --api-keys
MAX_KEY_CHARS = 4096
CACHE_ENTRIES = 4096
KEY_PREFIX = "ss-"
KEY_ID_CHARS = 12  # 36**12 ~ 2**62: ids of random keys do not collide
KEY_ID_ALPHABET = string.ascii_lowercase + string.digits
MIN_SECRET_CHARS = 32
# A key with an id; the secret's length keeps every old `generate` key ("ss-" + 43) out.
KEY_WITH_ID = re.compile(rb"ss-([a-z0-9]{%d})_[A-Za-z0-9_-]{%d,}" % (KEY_ID_CHARS, MIN_SECRET_CHARS))
ENTRY_ID = re.compile(r"ss-[a-z0-9]{%d}" % KEY_ID_CHARS)
MIGRATE_WITHOUT_ID = (
    "entries without a key id ('scrypt$...' rather than 'ss-<id>$scrypt$...') still work, but every key "
    "without an id is hashed against each of them; to migrate, make keys with ids (`python -m splitserve.keys "
    "generate --tenant NAME`), hand them out, then remove the old entries")

log = logging.getLogger(__name__)


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file and the field."""


def key_id_of(key: bytes) -> str | None:
    """The id of a key of the form `ss-<id>_<secret>`; None for any other key."""
    match = KEY_WITH_ID.fullmatch(key)
    return match.group(1).decode() if match else None


def new_key() -> str:
    """A new random key with an id: `ss-<id>_<secret>` (62 bits of id, 256 bits of secret)."""
    key_id = "".join(secrets.choice(KEY_ID_ALPHABET) for _ in range(KEY_ID_CHARS))
    return f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise KeysFileError(f"{where}: not URL-safe base64") from None


@dataclass(frozen=True)
class KeyHash:
    """One stored key: its id ("" for an entry without one), algorithm, parameters, salt and digest."""

    algorithm: str
    digest: bytes
    salt: bytes = b""
    params: tuple[int, ...] = ()
    key_id: str = ""

    def compute(self, key: bytes) -> bytes:
        """The digest of a candidate key under this entry's algorithm, salt and parameters."""
        if self.algorithm == "sha256":
            return hashlib.sha256(key).digest()
        if self.algorithm == "pbkdf2_sha256":
            return hashlib.pbkdf2_hmac("sha256", key, self.salt, self.params[0], dklen=len(self.digest))
        n, r, p = self.params
        return hashlib.scrypt(key, salt=self.salt, n=n, r=r, p=p, maxmem=2 * 128 * n * r * p + (1 << 20),
                              dklen=len(self.digest))

    def matches(self, key: bytes) -> bool:
        return hmac.compare_digest(self.compute(key), self.digest)

    def encode(self) -> str:
        prefix = f"{KEY_PREFIX}{self.key_id}$" if self.key_id else ""
        if self.algorithm == "sha256":
            return f"{prefix}sha256${self.digest.hex()}"
        return prefix + "$".join([self.algorithm, *map(str, self.params), _b64(self.salt), _b64(self.digest)])


def hash_key(key: str, algorithm: str = DEFAULT_ALGORITHM, *, scrypt_params: tuple[int, int, int] = SCRYPT_DEFAULT,
             pbkdf2_iterations: int = PBKDF2_DEFAULT_ITERATIONS) -> str:
    """The keys-file entry of `key` (a fresh random salt each time); `ss-<id>$...` when the key
    has an id."""
    _check_key_text(key)
    salt = secrets.token_bytes(SALT_BYTES)
    if algorithm == "sha256":
        entry = KeyHash("sha256", b"")
    elif algorithm == "pbkdf2_sha256":
        entry = KeyHash("pbkdf2_sha256", b"\0" * DIGEST_BYTES, salt, (pbkdf2_iterations,))
    elif algorithm == "scrypt":
        entry = KeyHash("scrypt", b"\0" * DIGEST_BYTES, salt, tuple(scrypt_params))
    else:
        raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    entry = parse_key_hash(entry.encode(), "algorithm") if algorithm != "sha256" else entry  # bounds
    return KeyHash(entry.algorithm, entry.compute(key.encode()), entry.salt, entry.params,
                   key_id_of(key.encode()) or "").encode()


def _check_key_text(key: str) -> None:
    if not key or key != key.strip() or len(key) > MAX_KEY_CHARS or not key.isprintable():
        raise ValueError(f"key: an API key is 1 to {MAX_KEY_CHARS} printable characters without surrounding "
                         "spaces")


def _int(text: str, where: str) -> int:
    if not text.isdigit():
        raise KeysFileError(f"{where}: expected a positive integer, got {text!r}")
    return int(text)


def parse_key_hash(text: Any, where: str) -> KeyHash:
    """One key entry; KeysFileError naming `where` (e.g. "tenants[0].keys[1]") when malformed.
    The message never quotes the entry (a plain key pasted by mistake must not reach a log)."""
    if not isinstance(text, str):
        raise KeysFileError(f"{where}: expected a string, got {type(text).__name__}")
    text = text.strip()
    if not text.startswith(KEY_PREFIX):
        return _parse_hash(text, where)
    head, dollar, rest = text.partition("$")
    if not dollar or not ENTRY_ID.fullmatch(head) or rest.startswith(KEY_PREFIX):
        raise KeysFileError(f"{where}: an entry with a key id is 'ss-<id>$' and a hash (e.g. 'ss-<id>$scrypt$...'), "
                            f"the id {KEY_ID_CHARS} lowercase letters or digits (a plain key does not belong in the "
                            "file: hash it with `python -m splitserve.keys hash`)")
    return replace(_parse_hash(rest, where), key_id=head[len(KEY_PREFIX):])


def _parse_hash(text: str, where: str) -> KeyHash:
    parts = text.split("$")
    algorithm = parts[0]
    if algorithm == "sha256":
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[1]):
            raise KeysFileError(f"{where}: a sha256 entry is 'sha256$' and 64 hex digits")
        return KeyHash("sha256", bytes.fromhex(parts[1]))
    if algorithm == "pbkdf2_sha256":
        if len(parts) != 4:
            raise KeysFileError(f"{where}: a pbkdf2_sha256 entry is 'pbkdf2_sha256$<iterations>$<salt>$<hash>'")
        iterations = _int(parts[1], f"{where}: iterations")
        low, high = PBKDF2_ITERATIONS_RANGE
        if not low <= iterations <= high:
            raise KeysFileError(f"{where}: iterations must be in [{low}, {high}], got {iterations}")
        entry = KeyHash(algorithm, _unb64(parts[3], f"{where}: hash"), _unb64(parts[2], f"{where}: salt"),
                        (iterations,))
    elif algorithm == "scrypt":
        if len(parts) != 6:
            raise KeysFileError(f"{where}: a scrypt entry is 'scrypt$<N>$<r>$<p>$<salt>$<hash>'")
        n, r, p = (_int(v, f"{where}: {name}") for v, name in zip(parts[1:4], ("N", "r", "p")))
        if n < 2 or n & (n - 1) or r < 1 or p < 1 or 128 * n * r * p > MAX_SCRYPT_MEMORY:
            raise KeysFileError(f"{where}: scrypt needs N a power of 2 > 1, r >= 1, p >= 1 and 128*N*r*p <= "
                                f"{MAX_SCRYPT_MEMORY} bytes, got N={n} r={r} p={p}")
        entry = KeyHash(algorithm, _unb64(parts[5], f"{where}: hash"), _unb64(parts[4], f"{where}: salt"), (n, r, p))
    else:
        raise KeysFileError(f"{where}: not a key hash: an entry starts with one of {', '.join(ALGORITHMS)} and "
                            "'$' (a plain key does not belong in the file: hash it with `python -m splitserve.keys "
                            "hash`)")
    if len(entry.salt) < 8 or not 16 <= len(entry.digest) <= 64:
        raise KeysFileError(f"{where}: the salt must be at least 8 bytes and the hash 16 to 64 bytes")
    return entry


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's rate limits; None: the gateway's default (--rate-limit-*), 0: no limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def resolve(self, default_requests: int, default_tokens: int) -> tuple[int, int]:
        return (default_requests if self.requests_per_minute is None else self.requests_per_minute,
                default_tokens if self.tokens_per_minute is None else self.tokens_per_minute)


@dataclass(frozen=True)
class Tenant:
    """A tenant: its name, limits and the hashes of its keys."""

    name: str
    keys: tuple[KeyHash, ...]
    limits: TenantLimits = field(default_factory=TenantLimits)


def _limit(entry: Mapping[str, Any], name: str, where: str) -> int | None:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KeysFileError(f"{where}.{name}: expected an integer >= 0 (0: no limit), got {value!r}")
    return value


def parse_tenants(document: Any, source: str = "keys file") -> list[Tenant]:
    """Tenants from a parsed JSON/TOML document; KeysFileError naming the source and field."""
    if not isinstance(document, dict) or not isinstance(document.get("tenants"), list):
        raise KeysFileError(f"{source}: tenants: expected a list of tenants at the top level")
    unknown = set(document) - {"tenants"}
    if unknown:
        raise KeysFileError(f"{source}: unknown top-level fields {sorted(unknown)} (only 'tenants')")
    tenants: list[Tenant] = []
    seen: set[str] = set()
    key_ids: dict[str, str] = {}  # an id: where it was first seen
    for i, entry in enumerate(document["tenants"]):
        where = f"{source}: tenants[{i}]"
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where}: expected a table/object with name and keys")
        unknown = set(entry) - {"name", "keys", "requests_per_minute", "tokens_per_minute"}
        if unknown:
            raise KeysFileError(f"{where}: unknown fields {sorted(unknown)} (name, keys, requests_per_minute, "
                                f"tokens_per_minute)")
        name = entry.get("name")
        if not isinstance(name, str) or not TENANT_NAME.match(name):
            raise KeysFileError(f"{where}.name: 1 to 64 letters, digits, '.', '_' or '-' (not starting with a "
                                f"punctuation mark), got {name!r}")
        if name in seen:
            raise KeysFileError(f"{where}.name: tenant {name!r} appears twice")
        seen.add(name)
        keys = entry.get("keys")
        if not isinstance(keys, list) or not keys:
            raise KeysFileError(f"{where}.keys: expected a non-empty list of key hashes")
        hashes = tuple(parse_key_hash(k, f"{where}.keys[{j}]") for j, k in enumerate(keys))
        for j, key_hash in enumerate(hashes):
            if key_hash.key_id in key_ids:
                raise KeysFileError(f"{where}.keys[{j}]: key id {key_hash.key_id!r} appears twice (also "
                                    f"{key_ids[key_hash.key_id]}); ids are unique across the file")
            if key_hash.key_id:
                key_ids[key_hash.key_id] = f"tenants[{i}].keys[{j}]"
        limits = TenantLimits(_limit(entry, "requests_per_minute", where), _limit(entry, "tokens_per_minute", where))
        tenants.append(Tenant(name, hashes, limits))
    return tenants


def load_keys_file(path: str | Path) -> list[Tenant]:
    """Read and parse a keys file: `.json` as JSON, anything else as TOML."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise KeysFileError(f"api_keys_file: cannot read {path}: {err.strerror or err}") from None
    try:
        if path.suffix.lower() == ".json":
            document = json.loads(raw)
        else:
            document = tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        kind = "JSON" if path.suffix.lower() == ".json" else "TOML"
        # The parser's message quotes no more than a position; never the file's content.
        raise KeysFileError(f"api_keys_file: {path} is not valid {kind}: {_position_only(err)}") from None
    return parse_tenants(document, f"api_keys_file {path}")


def _position_only(err: Exception) -> str:
    if isinstance(err, json.JSONDecodeError):
        return f"{err.msg} at line {err.lineno} column {err.colno}"
    match = re.search(r"\(at line \d+, column \d+\)|at line \d+", str(err))
    return match.group(0) if match else type(err).__name__


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tenant (metrics label), the owner id of its sessions and rate-limit
    buckets (never the key), and the tenant's limits (None: the gateway's defaults)."""

    tenant: str = ""
    owner: str = ""
    limits: TenantLimits | None = None


ANONYMOUS = Caller()


def plain_key_owner(key: bytes) -> str:
    """The owner id of a key given with --api-keys: per key, as before tenants existed."""
    return hashlib.sha256(key).hexdigest()[:24]


class _Bounded(collections.OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def put(self, key: bytes, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


WITHOUT_ID = "without-id"  # the slow lane of keys without an id (see KeyVerifier.slow_lane)


class KeyVerifier:
    """Checks presented keys against plain keys (`--api-keys`, held as SHA-256 digests) and the
    tenants of a keys file. Thread-safe: the slow path may run in a worker thread."""

    def __init__(self, tenants: Sequence[Tenant] = (), plain_keys: Sequence[str] = (),
                 cache_entries: int = CACHE_ENTRIES):
        self.tenants = list(tenants)
        # Digest of a plain key -> its owner id: no plain key kept in memory either. Found by a dict
        # lookup: the SHA-256 of a guess tells nothing about how near it came to a key.
        self._plain = {hashlib.sha256(k.encode()).digest(): plain_key_owner(k.encode()) for k in plain_keys if k}
        self._by_id: dict[str, tuple[KeyHash, Caller]] = {}
        self._without_id: list[tuple[KeyHash, Caller]] = []
        for tenant in self.tenants:
            caller = Caller(tenant.name, f"tenant:{tenant.name}", tenant.limits)
            for entry in tenant.keys:
                if not entry.key_id:
                    self._without_id.append((entry, caller))
                elif entry.key_id in self._by_id:
                    raise KeysFileError(f"tenants: key id {entry.key_id!r} appears twice")
                else:
                    self._by_id[entry.key_id] = (entry, caller)
        if self._without_id:
            log.warning("API keys file: %d %s", len(self._without_id), MIGRATE_WITHOUT_ID)
        self._secret = secrets.token_bytes(32)
        self._accepted: _Bounded = _Bounded(cache_entries)
        self._refused: _Bounded = _Bounded(cache_entries)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self._plain or self.tenants)

    @property
    def plain_keys(self) -> int:
        """How many keys were given in plain (--api-keys)."""
        return len(self._plain)

    @property
    def has_tenant_limits(self) -> bool:
        return any(t.limits != TenantLimits() for t in self.tenants)

    def _tag(self, key: bytes) -> bytes:
        return hmac.new(self._secret, key, hashlib.sha256).digest()

    def cached(self, key: bytes) -> Caller | None | bool:
        """The cached verdict on `key`: its Caller, False when refused before, None when unseen."""
        tag = self._tag(key)
        with self._lock:
            if tag in self._accepted:
                return self._accepted[tag]
            if tag in self._refused:
                return False
        return None

    @property
    def entries_without_id(self) -> int:
        """How many entries of the keys file have no key id (see MIGRATE_WITHOUT_ID)."""
        return len(self._without_id)

    def slow_lane(self, key: bytes) -> str | None:
        """What an unseen `key` is slowly hashed against: "id:<id>" (the one entry of its id),
        WITHOUT_ID (every entry without an id), or None when it costs no slow hash (an id no
        entry has; or only plain keys to compare, one SHA-256 in all). The gateway queues slow
        checks per lane, so tokens aimed at one lane cannot hold up another."""
        key_id = key_id_of(key)
        if key_id is not None:
            return f"id:{key_id}" if key_id in self._by_id else None
        return WITHOUT_ID if self._without_id else None

    def verify(self, key: bytes) -> Caller | None:
        """The caller `key` belongs to, or None. An unseen key costs at most one slow hash with
        an id (none for an unknown id), one per entry without an id otherwise."""
        verdict = self.cached(key)
        if verdict is not None:
            return verdict or None
        caller = self._verify_uncached(key)
        if caller is None and self.slow_lane(key) is None:
            return None  # refused for the cost of a lookup: caching it would only evict others
        tag = self._tag(key)
        with self._lock:
            if caller is None:
                self._refused.put(tag, True)
            else:
                self._accepted.put(tag, caller)
        return caller

    def _verify_uncached(self, key: bytes) -> Caller | None:
        found: Caller | None = None
        # Every candidate entry is checked, without stopping at a match: the time taken does not
        # tell which tenant (or whether any) a key nearly matched. Which entry a key's id names
        # is no secret, so a key with an id is hashed against that entry alone.
        owner = self._plain.get(hashlib.sha256(key).digest())
        if owner is not None:
            found = Caller(DEFAULT_TENANT, owner, None)
        key_id = key_id_of(key)
        if key_id is not None:
            named = self._by_id.get(key_id)
            candidates = [named] if named is not None else []
        else:
            candidates = self._without_id
        for entry, caller in candidates:
            if entry.matches(key) and found is None:
                found = caller
        return found


# ---- command line: python -m splitserve.keys hash | generate | check -----------------------


def _read_key(stream: Any = None) -> str:
    """The key from stdin: a prompt without echo on a terminal, else the first line."""
    stream = stream or sys.stdin
    if stream.isatty():
        import getpass

        return getpass.getpass("API key (not echoed): ")
    return stream.readline().rstrip("\r\n")


def _hash_and_note(key: str, algorithm: str) -> str:
    """The entry of `key`; a note on stderr when the key has no id."""
    entry = hash_key(key, algorithm)
    if key_id_of(key.encode()) is None:
        print(f"note: this key has no id (ss-<id>_<secret>, from `generate`): {MIGRATE_WITHOUT_ID}", file=sys.stderr)
    return entry


def hash_key_command(algorithm: str = DEFAULT_ALGORITHM) -> None:
    """Print the keys-file entry of an API key read from stdin (never from the command line)."""
    try:
        print(_hash_and_note(_read_key(), algorithm))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m splitserve.keys",
                                     description="API keys hashed at rest for the gateway's --api-keys-file.")
    sub = parser.add_subparsers(dest="command", required=True)
    hash_p = sub.add_parser("hash", help="read a key on stdin, print its entry for the keys file (with the key's "
                                         "id when it is of the form ss-<id>_<secret>)")
    hash_p.add_argument("--algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM)
    gen_p = sub.add_parser("generate", help="make a new random key with an id (ss-<id>_<secret>); print it and "
                                            "its entry")
    gen_p.add_argument("--algorithm", choices=ALGORITHMS, default=DEFAULT_ALGORITHM)
    gen_p.add_argument("--tenant", default="", help="also print a TOML tenant table with this name")
    check_p = sub.add_parser("check", help="validate a keys file and list its tenants")
    check_p.add_argument("file")
    args = parser.parse_args(argv)
    try:
        if args.command == "hash":
            print(_hash_and_note(_read_key(), args.algorithm))
        elif args.command == "generate":
            key = new_key()
            entry = hash_key(key, args.algorithm)
            print(f"key:   {key}\nentry: {entry}")
            if args.tenant:
                if not TENANT_NAME.match(args.tenant):
                    raise ValueError(f"tenant: 1 to 64 letters, digits, '.', '_' or '-', got {args.tenant!r}")
                print(f'\n[[tenants]]\nname = "{args.tenant}"\nkeys = ["{entry}"]')
        else:
            without_id = 0
            for tenant in load_keys_file(args.file):
                rpm, tpm = tenant.limits.requests_per_minute, tenant.limits.tokens_per_minute
                print(f"{tenant.name}: {len(tenant.keys)} key(s), requests_per_minute="
                      f"{'default' if rpm is None else rpm}, tokens_per_minute={'default' if tpm is None else tpm}")
                without_id += sum(not entry.key_id for entry in tenant.keys)
            if without_id:
                print(f"note: {without_id} {MIGRATE_WITHOUT_ID}")
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
