"""API keys hashed at rest, tenants and their limits (splitserve/keys.py, the gateway's auth path)."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from gateway.core import GatewayCore
from gateway.rate_limit import KeyRateLimiter
from gateway.tokenization import Tokenization
from splitserve import keys as keys_mod
from splitserve.config import GatewayConfig
from splitserve.errors import InvalidArgument, Overloaded, Unauthenticated
from splitserve.keys import (
    DEFAULT_TENANT,
    KeysFileError,
    KeyVerifier,
    TenantLimits,
    hash_key,
    key_id_of,
    load_keys_file,
    new_key,
    parse_key_hash,
    parse_tenants,
)

FAST_SCRYPT = (1 << 10, 8, 1)  # tests: the format and the check, not the cost


def _scrypt(key: str) -> str:
    return hash_key(key, "scrypt", scrypt_params=FAST_SCRYPT)


@pytest.mark.parametrize("algorithm", ["scrypt", "pbkdf2_sha256", "sha256"])
def test_a_hashed_key_verifies_and_others_do_not(algorithm):
    entry = hash_key("sk-right", algorithm, scrypt_params=FAST_SCRYPT, pbkdf2_iterations=10_000)
    assert entry.startswith(algorithm + "$") and "sk-right" not in entry
    parsed = parse_key_hash(entry, "k")
    assert parsed.encode() == entry
    assert parsed.matches(b"sk-right")
    assert not parsed.matches(b"sk-right ") and not parsed.matches(b"sk-righ") and not parsed.matches(b"")


def test_salted_hashes_of_one_key_differ():
    assert _scrypt("same") != _scrypt("same")
    a = hash_key("same", "pbkdf2_sha256", pbkdf2_iterations=10_000)
    assert a != hash_key("same", "pbkdf2_sha256", pbkdf2_iterations=10_000)


@pytest.mark.parametrize("entry, fragment", [
    ("plain-key", "not a key hash"),
    ("scrypt", "a scrypt entry is"),
    ("sha256$abc", "64 hex digits"),
    ("scrypt$1000$8$1$c2FsdHNhbHQ$" + "A" * 43, "power of 2"),
    ("scrypt$1048576$64$1$c2FsdHNhbHQ$" + "A" * 43, "128*N*r*p"),
    ("scrypt$16384$8$1$salt", "scrypt$<N>$<r>$<p>$<salt>$<hash>"),
    ("pbkdf2_sha256$10$c2FsdHNhbHQ$" + "A" * 43, "iterations must be in"),
    ("pbkdf2_sha256$x$c2FsdHNhbHQ$" + "A" * 43, "positive integer"),
    ("pbkdf2_sha256$10000$c2E$" + "A" * 43, "salt must be at least 8 bytes"),
    ("scrypt$16384$8$1$c2FsdHNhbHQ$!!!", "hash: not URL-safe base64"),
    (42, "expected a string"),
])
def test_malformed_entries_are_refused_naming_the_field(entry, fragment):
    with pytest.raises(KeysFileError, match="^tenants\\[0\\]\\.keys\\[1\\]: ") as info:
        parse_key_hash(entry, "tenants[0].keys[1]")
    assert fragment in str(info.value)
    if isinstance(entry, str) and entry == "plain-key":
        assert "plain-key" not in str(info.value)  # a plain key pasted by mistake is never echoed


@pytest.mark.parametrize("algorithm", ["scrypt", "pbkdf2_sha256", "sha256"])
def test_a_key_with_an_id_has_an_entry_with_that_id(algorithm):
    key = new_key()
    key_id = key.split("_", 1)[0][3:]
    assert key.startswith("ss-") and len(key_id) == 12 and key_id_of(key.encode()) == key_id
    entry = hash_key(key, algorithm, scrypt_params=FAST_SCRYPT, pbkdf2_iterations=10_000)
    assert entry.startswith(f"ss-{key_id}${algorithm}$") and key.split("_", 1)[1] not in entry
    parsed = parse_key_hash(entry, "k")
    assert parsed.key_id == key_id and parsed.encode() == entry and parsed.matches(key.encode())
    assert not parsed.matches(f"ss-{key_id}_{new_key().split('_', 1)[1]}".encode())  # the id alone is nothing


def test_an_old_generated_key_is_never_taken_for_a_key_with_an_id():
    # The old `generate`: "ss-" + 43 URL-safe characters, which may hold a '_' anywhere.
    old = "ss-abcdefghijkl_" + "x" * 30
    assert key_id_of(old.encode()) is None
    verifier = KeyVerifier(parse_tenants({"tenants": [{"name": "old", "keys": [_scrypt(old)]}]}))
    assert verifier.verify(old.encode()).tenant == "old"  # entries without an id keep working


@pytest.mark.parametrize("entry, fragment", [
    ("ss-short$sha256$" + "0" * 64, "an entry with a key id is 'ss-<id>$'"),
    ("ss-abcdefghijkl", "an entry with a key id is 'ss-<id>$'"),
    ("ss-abcdefghijkl_" + "s" * 43, "a plain key does not belong in the file"),  # a key pasted as is
    ("ss-ABCDEFGHIJKL$sha256$" + "0" * 64, "12 lowercase letters or digits"),
    ("ss-abcdefghijkl$ss-abcdefghijkl$sha256$" + "0" * 64, "an entry with a key id"),
    ("ss-abcdefghijkl$sha256$00", "64 hex digits"),
])
def test_malformed_entries_with_ids_are_refused_naming_the_field(entry, fragment):
    with pytest.raises(KeysFileError, match="^tenants\\[0\\]\\.keys\\[1\\]: ") as info:
        parse_key_hash(entry, "tenants[0].keys[1]")
    assert fragment in str(info.value) and "s" * 43 not in str(info.value)


def test_a_key_id_appears_once_in_a_file():
    key = new_key()
    doc = {"tenants": [{"name": "a", "keys": [hash_key(key, "sha256")]},
                       {"name": "b", "keys": [_scrypt("x"), hash_key(key, "sha256")]}]}
    with pytest.raises(KeysFileError, match=r"f: tenants\[1\]\.keys\[1\]: key id '[a-z0-9]{12}' appears twice "
                                            r"\(also tenants\[0\]\.keys\[0\]\)"):
        parse_tenants(doc, "f")


def _count_hashes(monkeypatch) -> list[str]:
    """The key ids of the entries hashed from now on ("" for an entry without one)."""
    hashed: list[str] = []
    original = keys_mod.KeyHash.compute
    monkeypatch.setattr(keys_mod.KeyHash, "compute",
                        lambda self, key: hashed.append(self.key_id) or original(self, key))
    return hashed


def test_a_flood_of_random_tokens_costs_no_hash_and_a_real_key_still_verifies(tmp_path, monkeypatch):
    real = [new_key() for _ in range(3)]
    core = _core(tmp_path, keys_toml="".join(f'[[tenants]]\nname = "t{i}"\nkeys = ["{_scrypt(k)}"]\n'
                                             for i, k in enumerate(real)))
    hashed = _count_hashes(monkeypatch)
    flood = [new_key() for _ in range(500)] + [f"sk-random-{i}" for i in range(500)]

    async def run():
        # All at once, as a flood arrives: none waits for a hash, so none is refused with 429.
        results = await asyncio.gather(*(core.authorize(f"Bearer {k}") for k in flood), return_exceptions=True)
        assert all(isinstance(r, Unauthenticated) for r in results)
        assert hashed == [] and core._waiting_key_checks == 0
        assert len(core.keys._refused) == 0  # nothing that cost nothing pushes a costly verdict out
        caller = await core.authorize(f"Bearer {real[1]}")
        assert caller.tenant == "t1" and hashed == [key_id_of(real[1].encode())]  # one hash: its own entry
        wrong_secret = real[2].split("_", 1)[0] + "_" + new_key().split("_", 1)[1]
        with pytest.raises(Unauthenticated):
            await core.authorize(f"Bearer {wrong_secret}")
        assert len(hashed) == 2  # at most one hash for a token with a known id
    asyncio.run(run())


def test_tokens_without_an_id_cannot_hold_up_keys_with_one(tmp_path, monkeypatch):
    import threading

    import gateway.core as core_module

    real = new_key()
    core = _core(tmp_path, keys_toml=f'[[tenants]]\nname = "old"\nkeys = ["{_scrypt("k-old")}"]\n'
                                     f'[[tenants]]\nname = "new"\nkeys = ["{_scrypt(real)}"]\n')
    assert core.keys.entries_without_id == 1
    release = threading.Event()
    original = keys_mod.KeyHash.compute

    def compute(self, key):  # entries without an id hash until released: a slow flood in flight
        if not self.key_id:
            release.wait(10)
        return original(self, key)

    monkeypatch.setattr(keys_mod.KeyHash, "compute", compute)
    lane = core_module.MAX_WAITING_PER_LANE

    async def until(predicate):
        for _ in range(500):  # polling, bounded: 5 s
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def run():
        flood = [asyncio.ensure_future(core.authorize(f"Bearer k-flood-{i}")) for i in range(lane)]
        await until(lambda: core._waiting_key_checks == lane)
        with pytest.raises(Overloaded):  # that lane is full ...
            await core.authorize("Bearer k-one-too-many")
        caller = await asyncio.wait_for(core.authorize(f"Bearer {real}"), 5)  # ... the others are not
        assert caller.tenant == "new"
        release.set()
        results = await asyncio.gather(*flood, return_exceptions=True)
        assert all(isinstance(r, Unauthenticated) for r in results)
        assert (await core.authorize("Bearer k-old")).tenant == "old"  # and keys without an id still work
    asyncio.run(run())


def _doc(**tenant):
    return {"tenants": [{"name": "acme", "keys": [_scrypt("k-acme")], **tenant}]}


def test_tenants_parse_with_limits():
    doc = {"tenants": [{"name": "acme", "keys": [_scrypt("a1"), hash_key("a2", "sha256")], "requests_per_minute": 60},
                       {"name": "beta.team-2", "keys": [_scrypt("b1")], "tokens_per_minute": 0}]}
    acme, beta = parse_tenants(doc)
    assert (acme.name, len(acme.keys), acme.limits) == ("acme", 2, TenantLimits(60, None))
    assert beta.limits == TenantLimits(None, 0)
    assert acme.limits.resolve(10, 1000) == (60, 1000)  # unset: the gateway's default
    assert beta.limits.resolve(10, 1000) == (10, 0)  # 0: no limit for this tenant


@pytest.mark.parametrize("doc, fragment", [
    ([], "tenants: expected a list"),
    ({"tenants": {}}, "tenants: expected a list"),
    ({"tenants": [], "extra": 1}, "unknown top-level fields"),
    ({"tenants": ["acme"]}, "tenants[0]: expected a table"),
    (_doc(name="bad name"), "tenants[0].name: 1 to 64"),
    (_doc(name="-x"), "tenants[0].name"),
    (_doc(name="x" * 65), "tenants[0].name"),
    (_doc(keys=[]), "tenants[0].keys: expected a non-empty list"),
    (_doc(keys="sha256$00"), "tenants[0].keys: expected a non-empty list"),
    (_doc(requests_per_minute=-1), "tenants[0].requests_per_minute: expected an integer >= 0"),
    (_doc(tokens_per_minute=1.5), "tenants[0].tokens_per_minute"),
    (_doc(tokens_per_minute=True), "tenants[0].tokens_per_minute"),
    (_doc(burst=3), "unknown fields ['burst']"),
    ({"tenants": [_doc()["tenants"][0], _doc()["tenants"][0]]}, "tenants[1].name: tenant 'acme' appears twice"),
])
def test_bad_documents_are_refused_naming_the_field(doc, fragment):
    with pytest.raises(KeysFileError) as info:
        parse_tenants(doc, "f.toml")
    assert fragment in str(info.value) and str(info.value).startswith("f.toml: ")


def test_toml_and_json_files(tmp_path):
    entry = _scrypt("k-toml")
    toml_file = tmp_path / "keys.toml"
    toml_file.write_text(f'[[tenants]]\nname = "acme"\nrequests_per_minute = 5\nkeys = ["{entry}"]\n')
    json_file = tmp_path / "keys.json"
    json_file.write_text(json.dumps({"tenants": [{"name": "acme", "requests_per_minute": 5, "keys": [entry]}]}))
    assert load_keys_file(toml_file) == load_keys_file(json_file)
    broken = tmp_path / "broken.json"
    broken.write_text('{"tenants": [ {"name": "acme", "keys": ["sk-secret-plain"]')
    with pytest.raises(KeysFileError, match="api_keys_file: .*broken.json is not valid JSON") as info:
        load_keys_file(broken)
    assert "sk-secret-plain" not in str(info.value)
    with pytest.raises(KeysFileError, match="api_keys_file: cannot read"):
        load_keys_file(tmp_path / "missing.toml")


def test_verifier_caches_verdicts_and_never_holds_the_key(monkeypatch):
    tenants = parse_tenants({"tenants": [{"name": "acme", "keys": [_scrypt("k-a")], "requests_per_minute": 7},
                                         {"name": "beta", "keys": [_scrypt("k-b")]}]})
    verifier = KeyVerifier(tenants, plain_keys=["k-plain"])
    calls = []
    original = keys_mod.KeyHash.compute
    monkeypatch.setattr(keys_mod.KeyHash, "compute", lambda self, key: calls.append(1) or original(self, key))
    acme = verifier.verify(b"k-a")
    assert (acme.tenant, acme.owner, acme.limits) == ("acme", "tenant:acme", TenantLimits(7, None))
    assert len(calls) == 2  # every entry is hashed, without stopping at the match
    assert verifier.verify(b"k-a") == acme and len(calls) == 2  # then from the cache: no hashing
    assert verifier.verify(b"k-wrong") is None and len(calls) == 4
    assert verifier.verify(b"k-wrong") is None and len(calls) == 4  # a refused key is cached too
    plain = verifier.verify(b"k-plain")
    assert plain.tenant == DEFAULT_TENANT and plain.limits is None and len(plain.owner) == 24
    assert verifier.cached(b"k-b") is None
    assert verifier.verify(b"k-b").tenant == "beta"
    held = repr(vars(verifier)).encode()
    for key in (b"k-a", b"k-b", b"k-plain", b"k-wrong"):
        assert key not in held


def test_the_caches_are_bounded():
    # Refusals that cost a slow hash are cached (here: against an entry without an id).
    verifier = KeyVerifier(parse_tenants({"tenants": [{"name": "acme", "keys": [_scrypt("k-a")]}]}),
                           plain_keys=["p"], cache_entries=3)
    for i in range(10):
        verifier.verify(f"wrong-{i}".encode())
    assert len(verifier._refused) == 3


def _core(tmp_path, api_keys=(), keys_toml=None, **config) -> GatewayCore:
    keys_file = tmp_path / "keys.toml"
    keys_file.write_text(keys_toml or
                         f'[[tenants]]\nname = "acme"\ntokens_per_minute = 100\nkeys = ["{_scrypt("k-acme")}"]\n')

    class TinyTokenizer:
        chat_template = None

        def __len__(self) -> int:
            return 10

    cfg = GatewayConfig(model="/models/demo", api_keys=list(api_keys), api_keys_file=str(keys_file), **config)
    return GatewayCore(cfg, Tokenization(TinyTokenizer(), max_model_len=128), coordinator=None)


def test_gateway_core_accepts_file_and_plain_keys(tmp_path):
    core = _core(tmp_path, api_keys=["k-plain"])
    assert core.authenticate("Bearer k-acme") == "tenant:acme"
    assert len(core.authenticate("Bearer k-plain")) == 24  # per key, as before tenants
    for header in ("Bearer k-wrong", "Bearer " + "x" * 5000):
        with pytest.raises(Unauthenticated, match="invalid API key"):
            core.authenticate(header)
    with pytest.raises(Unauthenticated, match="missing API key"):
        core.authenticate(None)

    async def run():
        caller = await core.authorize("Bearer k-acme")
        assert (caller.tenant, caller.limits) == ("acme", TenantLimits(None, 100))
        with pytest.raises(Unauthenticated) as info:
            await core.authorize("Bearer k-wrong-async")
        assert "k-wrong-async" not in str(info.value)
        with pytest.raises(Unauthenticated):
            await core.authorize("Bearer k-wrong-async")  # the cached refusal
        # Concurrent first requests with one new key: one slow verification, the rest from the cache.
        callers = await asyncio.gather(*(core.authorize("Bearer k-plain") for _ in range(5)))
        assert {c.tenant for c in callers} == {DEFAULT_TENANT}
    asyncio.run(run())


def test_a_flood_of_unseen_keys_is_bounded_and_leaving_callers_keep_their_slot(tmp_path, monkeypatch):
    import threading

    import gateway.core as core_module
    from splitserve.errors import Overloaded

    core = _core(tmp_path)
    release = threading.Event()
    running, peak = [0], [0]
    lock = threading.Lock()

    def slow_verify(key):  # stands in for scrypt over every entry, on the thread
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait(10)
        with lock:
            running[0] -= 1
        return None

    monkeypatch.setattr(core.keys, "verify", slow_verify)
    monkeypatch.setattr(core_module, "MAX_WAITING_KEY_CHECKS", 3)

    async def until(predicate):
        for _ in range(500):  # polling, bounded: 5 s
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("timed out")

    async def run():
        waiting = [asyncio.ensure_future(core.authorize(f"Bearer k-flood-{i}")) for i in range(3)]
        await until(lambda: core._waiting_key_checks == 3 and running[0] == 1)
        with pytest.raises(Overloaded):  # the bound is on callers waiting
            await core.authorize("Bearer k-one-too-many")
        waiting[0].cancel()  # the caller whose key is being hashed leaves
        await asyncio.sleep(0.1)  # time for a wrongly freed slot to start a second hash
        release.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        assert all(isinstance(r, Unauthenticated) for r in results[1:])
    asyncio.run(run())
    assert peak[0] == 1


def test_a_bad_keys_file_stops_the_gateway_naming_it(tmp_path):
    with pytest.raises(KeysFileError, match="api_keys_file: cannot read"):
        GatewayCore(GatewayConfig(model="/m/x", api_keys_file=str(tmp_path / "nope.toml")), None, None)


class FakeBuckets:
    """StateStore.take_tokens over in-memory buckets that never refill (time stands still)."""

    def __init__(self):
        self.levels: dict[str, float] = {}

    async def take_tokens(self, takes):
        levels = [self.levels.setdefault(t.key, t.burst) for t in takes]
        waits = [(t.cost - level) / t.rate_per_s if t.cost > level else 0.0 for t, level in zip(takes, levels)]
        if max(waits) > 0:
            return False, max(waits), waits.index(max(waits))
        for t, level in zip(takes, levels):
            self.levels[t.key] = level - t.cost
        return True, 0.0, -1


def test_tenant_limits_override_the_defaults():
    async def run():
        store = FakeBuckets()
        limiter = KeyRateLimiter(store, requests_per_minute=2, tokens_per_minute=0, tenant_limits=True)
        acme, free = TenantLimits(requests_per_minute=3), TenantLimits(requests_per_minute=0)
        for _ in range(3):
            await limiter.check("tenant:acme", 10, acme, "acme")
        with pytest.raises(Overloaded, match="tenant acme is over its limit of 3 requests per minute "
                                             r"\(requests_per_minute in the API keys file\)"):
            await limiter.check("tenant:acme", 10, acme, "acme")
        for _ in range(50):  # 0: no limit for this tenant, whatever the default
            await limiter.check("tenant:free", 10, free, "free")
        await limiter.check("plain-owner", 10)
        await limiter.check("plain-owner", 10)
        with pytest.raises(Overloaded, match=r"this API key is over its limit of 2 requests per minute "
                                             r"\(--rate-limit-requests-per-minute\)"):
            await limiter.check("plain-owner", 10)
        # A tenant without a limit of its own gets the default, and is told where that was set.
        default = TenantLimits(tokens_per_minute=500)
        await limiter.check("tenant:plain", 10, default, "plain")
        await limiter.check("tenant:plain", 10, default, "plain")
        with pytest.raises(Overloaded, match=r"\(--rate-limit-requests-per-minute\)"):
            await limiter.check("tenant:plain", 10, default, "plain")
        assert set(store.levels) == {"requests:tenant:acme", "requests:plain-owner", "requests:tenant:plain",
                                     "tokens:tenant:plain"}
        tokens = KeyRateLimiter(store, tenant_limits=True)
        assert tokens.enabled and not KeyRateLimiter(store).enabled
        with pytest.raises(InvalidArgument, match="tenant acme's limit of 100 tokens per minute") as info:
            await tokens.check("tenant:acme", 101, TenantLimits(tokens_per_minute=100), "acme")
        assert info.value.param == "max_tokens"
    asyncio.run(run())


def test_hash_command_reads_the_key_from_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-from-stdin\n"))
    assert keys_mod.main(["hash", "--algorithm", "sha256"]) == 0
    out = capsys.readouterr().out.strip()
    assert parse_key_hash(out, "out").matches(b"sk-from-stdin") and "sk-from-stdin" not in out
    monkeypatch.setattr("sys.stdin", io.StringIO(" padded\n"))
    assert keys_mod.main(["hash"]) == 2
    assert "key: an API key is" in capsys.readouterr().err
    assert keys_mod.main(["generate", "--algorithm", "sha256", "--tenant", "acme"]) == 0
    lines = capsys.readouterr().out.splitlines()
    key, entry = lines[0].split()[1], lines[1].split()[1]
    assert parse_key_hash(entry, "e").matches(key.encode()) and 'name = "acme"' in lines
    assert parse_key_hash(entry, "e").key_id == key_id_of(key.encode()) is not None  # generated keys have ids
    monkeypatch.setattr("sys.stdin", io.StringIO(key + "\n"))
    assert keys_mod.main(["hash"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(entry.split("$")[0] + "$scrypt$") and captured.err == ""
    monkeypatch.setattr("sys.stdin", io.StringIO("sk-no-id\n"))
    assert keys_mod.main(["hash"]) == 0
    assert "note: this key has no id" in capsys.readouterr().err


def test_check_command_lists_tenants(tmp_path, capsys):
    path = tmp_path / "k.json"
    path.write_text(json.dumps(_doc(requests_per_minute=9)))
    assert keys_mod.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "acme: 1 key(s), requests_per_minute=9, tokens_per_minute=default" in out
    assert "note: 1 entries without a key id" in out and "generate" in out  # how to migrate
    path.write_text(json.dumps({"tenants": [{"name": "acme", "keys": [hash_key(new_key(), "sha256")]}]}))
    assert keys_mod.main(["check", str(path)]) == 0
    assert "note" not in capsys.readouterr().out
    path.write_text(json.dumps(_doc(name="")))
    assert keys_mod.main(["check", str(path)]) == 2
    assert "tenants[0].name" in capsys.readouterr().err


def test_hash_key_command_mounts_on_a_typer_app(monkeypatch):
    """The command `splitserve hash-key` becomes with one line in splitserve/cli/app.py."""
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command("hash-key")(keys_mod.hash_key_command)
    app.command("noop")(lambda: None)  # two commands: typer keeps the sub-command name
    result = CliRunner().invoke(app, ["hash-key", "--algorithm", "sha256"], input="sk-typer\n")
    assert result.exit_code == 0, result.output
    assert parse_key_hash(result.stdout.strip(), "out").matches(b"sk-typer")
    assert CliRunner().invoke(app, ["hash-key", "--algorithm", "md5"], input="sk\n").exit_code != 0
