"""Every ``KVCANARY_*`` variable is read by name and refused outside its documented range (never clamped, rounded
or replaced by a default), where the thing it configures is first used and before that thing writes anything;
``kvcanary info`` reports a wrong one plainly."""

from __future__ import annotations

import json
import re

import pytest

from kvcanary_cupy import CanaryArgumentError, cache, hostcuda, settings
from kvcanary_cupy.backends import host_sanitizer_requested, resolve_backend, unavailable_reason
from kvcanary_cupy.cli import main
from kvcanary_cupy.dlpack import Device

# Hand-worked: variable -> ({value: what the package uses}, [values refused]). Empty means unset everywhere.
CASES: dict[str, tuple[dict[str, object], list[str]]] = {
    "KVCANARY_CACHE_MAX_MB": ({"0": 0.0, "512": 512.0, "0.5": 0.5, "1048576": 1048576.0},
                              ["inf", "nan", "-1", "1e3", "1048577", "512MB", " 512", "0x10", "\u0665", "1_0"]),
    "KVCANARY_HOST_SANITIZE": ({"0": "off", "1": "address", "thread": "thread"},
                               ["yes", "true", "2", "THREAD", "address", " 1", "off"]),
    "KVCANARY_HOST_THREADS": ({"1": 1, "4": 4, "256": 256},
                              ["0", "257", "1000", "-1", "two", "4.0", "+4", " 4", "\u00b2"]),
    "KVCANARY_HOST_SPIN_US": ({"0": 0, "200": 200, "1000000": 1000000},
                              ["-1", "1000001", "2.5", "fast", " 5", "\u00b2"]),
    "KVCANARY_MAX_ALLOCATION_BYTES": ({"1": 1, "4096": 4096, str((1 << 63) - 1): (1 << 63) - 1},
                                      ["0", "-5", "lots", "1e9", "4096.0", "\u00b2", str(1 << 63)]),
    "KVCANARY_DEBUG": ({"0": False, "1": True}, ["yes", "2"]),
    "KVCANARY_REPLAY_SANITIZED_CHILD": ({"1": True}, ["0", "yes"]),
    "KVCANARY_CACHE_DIR": ({"/tmp/x": "/tmp/x", "relative/dir": "relative/dir"}, []),
    "KVCANARY_VLLM": ({"log": "log", "raise": "raise", "off": "off"}, ["LOG", "loud", "on", "1"]),
    "KVCANARY_VLLM_REAL_KV_HASH": ({"partial": "partial", "all": "all", "none": "none"}, ["some", "ALL"]),
    "KVCANARY_VLLM_WITH_V": ({"1": True, "0": False, "yes": True, "false": False}, ["maybe", "2", "True"]),
    "KVCANARY_VLLM_BACKEND": ({"auto": "auto", "numpy": "numpy", "host": "host", "cuda": "cuda"},
                              ["gpu", "Host", "cpu"]),
    "KVCANARY_VLLM_RING_CAPACITY": ({"1": 1, "4096": 4096, "2147483647": 2147483647},
                                    ["0", "-1", "2147483648", "4096.0", "big"]),
    "KVCANARY_VLLM_SWEEP_INTERVAL": ({"0": 0, "8": 8}, ["-1", "often", "8.5", "2147483648"]),
    "KVCANARY_VLLM_LOG_ROWS": ({"0": 0, "5": 5, "1000": 1000}, ["-1", "1001", "5.0", "few", " 5"]),
    "KVCANARY_VLLM_ALLOW_UNTESTED": ({"1": True, "0": False, "yes": True, "false": False}, ["maybe", "2", "True"]),
    "KVCANARY_VLLM_FAULT": ({"wrong-token": ("wrong-token", 3, None), "kv-bitflip@0": ("kv-bitflip", 0, None),
                             "slot-mapping@60": ("slot-mapping", 60, None),
                             "kv-bitflip@3:rank1": ("kv-bitflip", 3, 1), "wrong-token:rank0": ("wrong-token", 3, 0)},
                            ["junk", "wrong-token@x", "wrong-token@", "wrong-token@-1", "@3", "wrong-token@3.5",
                             "Wrong-Token", "wrong-token@2147483648", "wrong-token@3@4", "kv-bitflip@3:rank",
                             "kv-bitflip@3:1", "kv-bitflip@3:rank-1", "kv-bitflip@3:rank1:rank2",
                             "kv-bitflip@3:Rank1", "kv-bitflip@3:rank2147483648"]),
    "KVCANARY_VLLM_CONNECTOR": ({"ExampleConnector": "ExampleConnector", "LMCacheConnectorV1": "LMCacheConnectorV1"},
                                ["CanaryConnector", "Example Connector", "a.b:C", "1Connector", "Conn;rm"]),
    "KVCANARY_VLLM_CONNECTOR_ON_REFUSED": ({"report": "report", "load-error": "load-error"},
                                           ["recompute", "Report", "1"]),
}


def test_every_variable_has_its_cases():
    assert set(CASES) == set(settings.SETTINGS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_variable_is_parsed_inside_its_range_and_refused_outside_naming_it(name):
    good, bad = CASES[name]
    assert settings.read(name, {}) is None and settings.read(name, {name: ""}) is None
    for raw, want in good.items():
        got = settings.read(name, {name: raw})
        assert got == want and type(got) is type(want), (raw, got)
    for raw in bad:
        with pytest.raises(CanaryArgumentError, match=rf"^kv-canary: {name} must be .*, got {re.escape(repr(raw))}$"):
            settings.read(name, {name: raw})
    if bad:
        assert settings.problems({name: bad[0]}) == [
            f"kv-canary: {name} must be {settings.SETTINGS[name].allowed}, got {bad[0]!r}"]


def test_host_threads_above_the_range_are_refused_not_clamped(monkeypatch):
    monkeypatch.setenv(hostcuda.THREADS_ENV, "256")
    assert hostcuda.default_host_threads() == 256
    for raw in ("257", "100000"):
        monkeypatch.setenv(hostcuda.THREADS_ENV, raw)
        with pytest.raises(CanaryArgumentError, match=r"^kv-canary: KVCANARY_HOST_THREADS must be an integer "
                                                      r"from 1 to 256"):
            hostcuda.default_host_threads()


@pytest.mark.parametrize("raw", ["inf", "nan", "-1", "lots"])
def test_a_wrong_cache_cap_is_refused_before_a_host_build_writes_anything(tmp_path, monkeypatch, raw):
    if unavailable_reason("host") is not None:
        pytest.skip(f"host backend: {unavailable_reason('host')}")
    root = tmp_path / "cache"
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(root))
    monkeypatch.setenv("KVCANARY_CACHE_MAX_MB", raw)
    with pytest.raises(CanaryArgumentError, match=r"^kv-canary: KVCANARY_CACHE_MAX_MB must be a number of MiB"):
        cache.max_bytes()
    with pytest.raises(CanaryArgumentError, match=r"^kv-canary: KVCANARY_CACHE_MAX_MB"):
        hostcuda.HostModule('extern "C" __global__ void k(int* p) { p[0] = 1; }', name="cap_probe")
    assert not root.exists()  # no folder created, nothing compiled


def test_wrong_host_threads_and_spin_are_refused_before_a_host_build_writes_anything(tmp_path, monkeypatch):
    if unavailable_reason("host") is not None:
        pytest.skip(f"host backend: {unavailable_reason('host')}")
    root = tmp_path / "cache"
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(root))
    for name, raw in ((hostcuda.THREADS_ENV, "300"), (hostcuda.SPIN_ENV, "-1")):
        monkeypatch.setenv(name, raw)
        with pytest.raises(CanaryArgumentError, match=rf"^kv-canary: {name}"):
            hostcuda.HostModule('extern "C" __global__ void k(int* p) { p[0] = 1; }', name="env_probe")
        monkeypatch.delenv(name)
    assert not root.exists()


def test_a_junk_sanitizer_setting_is_refused_not_taken_as_on(monkeypatch):
    for raw, want in (("", None), ("0", None), ("1", "address"), ("thread", "thread")):
        monkeypatch.setenv("KVCANARY_HOST_SANITIZE", raw)
        assert host_sanitizer_requested() == want
    monkeypatch.setenv("KVCANARY_HOST_SANITIZE", "yes please")
    with pytest.raises(CanaryArgumentError, match=r"^kv-canary: KVCANARY_HOST_SANITIZE must be 0 \(off\), 1"):
        host_sanitizer_requested()
    if unavailable_reason("host") is None:
        with pytest.raises(CanaryArgumentError, match=r"^kv-canary: KVCANARY_HOST_SANITIZE"):
            resolve_backend("host", Device("cpu", 0))


def test_info_reports_a_wrong_variable_plainly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCANARY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCANARY_CACHE_MAX_MB", "inf")
    monkeypatch.setenv("KVCANARY_HOST_THREADS", "999")
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["caches"][0]["cap_bytes"] is None
    assert info["settings"] == [
        "kv-canary: KVCANARY_CACHE_MAX_MB must be a number of MiB from 0 to 1048576 (such as 512 or 0.5), got 'inf'",
        "kv-canary: KVCANARY_HOST_THREADS must be an integer from 1 to 256, got '999'"]
    assert main(["info"]) == 0
    out = capsys.readouterr()
    assert "  KVCANARY_CACHE_MAX_MB must be a number of MiB" in out.out and "error" not in out.err
    monkeypatch.delenv("KVCANARY_CACHE_MAX_MB")
    monkeypatch.delenv("KVCANARY_HOST_THREADS")
    assert main(["info"]) == 0
    assert "every KVCANARY_* variable that is set is valid" in capsys.readouterr().out


def test_unknown_plugin_variables_are_listed():
    env = {"KVCANARY_VLLM": "log", "KVCANARY_VLLM_BACKNED": "numpy", "KVCANARY_VLLM_BACKEND": "numpy",
           "KVCANARY_OTHER": "1"}
    assert settings.unknown_vllm_variables(env) == ["KVCANARY_VLLM_BACKNED"]
    assert [p for p in settings.problems(env)] == [
        f"kv-canary: KVCANARY_VLLM_BACKNED is not a variable of the vLLM plugin (known: "
        f"{', '.join(n for n in settings.SETTINGS if n.startswith('KVCANARY_VLLM'))})"]


@pytest.mark.parametrize(("value", "traceback"), [("0", False), ("", False), ("1", True), ("yes", False)])
def test_kvcanary_debug_0_keeps_an_internal_error_short_and_1_shows_its_traceback(monkeypatch, capsys, value,
                                                                                   traceback):
    import kvcanary_cupy.cli as cli

    def broken(args):
        raise RuntimeError("a planted internal error")

    monkeypatch.setattr(cli, "_cmd_info", broken)
    monkeypatch.setenv("KVCANARY_DEBUG", value)
    if traceback:
        with pytest.raises(RuntimeError, match="a planted internal error"):
            main(["info"])
        return
    assert main(["info"]) == 3
    err = capsys.readouterr().err
    assert ("kvcanary info: internal error: RuntimeError: a planted internal error (set KVCANARY_DEBUG=1 for the "
            "traceback)\n") in err
    assert ("KVCANARY_DEBUG must be" in err) == (value == "yes")  # junk is said, not taken as on
