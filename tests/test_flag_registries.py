"""Each flag with a registry offers exactly the registry's names: no choice without an implementation, no
implementation without a flag value. The CLI's choices (argparse) are checked, not only ServerArgs' metadata."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

import pytest

from moeserve import args as args_module
from moeserve.args import PD_ONLY_DEFAULTS, PDOptions, PDRole, ServerArgs
from moeserve.constrained.registry import GRAMMAR_BACKENDS
from moeserve.ep import registry as ep_registry
from moeserve.ep.all2all import resolve_deepep_mode
from moeserve.eplb import rebalancer, recorder
from moeserve.eplb.location import DISPATCH_ALGORITHMS
from moeserve.layers.moe.experts import RUNNER_BACKENDS
from moeserve.models import loader
from moeserve.text.parsers.reasoning import REASONING_PARSERS
from moeserve.text.parsers.tool_calls import TOOL_CALL_PARSERS


def cli_choices() -> dict[str, set]:
    """Each flag's choices as `moeserve serve` offers them."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {a.dest: set(a.choices) for a in parser._actions if a.choices}


def registries() -> dict[str, set]:
    """flag -> the names its implementation knows, read where the implementation reads them."""
    return {
        "moe_a2a_backend": {cls.name for cls in ep_registry.BACKENDS.values()},
        "deepep_mode": {m for m in args_module.DEEPEP_MODES if resolve_deepep_mode(m, None)},
        "moe_runner_backend": set(RUNNER_BACKENDS),
        "expert_distribution_recorder_mode": set(recorder.RECORDER_MODES),
        "ep_dispatch_algorithm": set(DISPATCH_ALGORITHMS),
        "eplb_algorithm": {name for name, policy in rebalancer.ALGORITHMS.items() if callable(policy)},
        "eplb_expert_weights": set(rebalancer.WEIGHT_SOURCES),
        "disaggregation_transfer_backend": {name for name, (module, _) in args_module.TRANSFER_BACKENDS.items()
                                            if importlib.util.find_spec(module) is not None},
        "disaggregation_mode": {role.value for role in PDRole},
        "dtype": {"auto", *loader._DTYPES},
        "grammar_backend": set(GRAMMAR_BACKENDS),
        "reasoning_parser": set(REASONING_PARSERS),
        "tool_call_parser": set(TOOL_CALL_PARSERS),
    }


def mismatches(choices: dict[str, set], names: dict[str, set]) -> list[str]:
    return [f"{flag}: flag only {sorted(choices.get(flag, set()) - known)}, registry only "
            f"{sorted(known - choices.get(flag, set()))}"
            for flag, known in names.items() if choices.get(flag) != known]


def test_every_registry_backed_flag_offers_exactly_the_registry():
    assert mismatches(cli_choices(), registries()) == []


def test_a_mismatch_is_caught(monkeypatch):
    # a dispatcher registered without a flag value, as if the flag kept its own copy of the list
    monkeypatch.setitem(ep_registry.BACKENDS, "deepep", type("DeepEP", (), {"name": "deepep"}))
    assert mismatches(cli_choices(), registries()) == ["moe_a2a_backend: flag only [], registry only ['deepep']"]
    # and a flag value nothing implements
    choices = cli_choices()
    choices["eplb_algorithm"] = choices["eplb_algorithm"] | {"greedy"}
    assert any(m.startswith("eplb_algorithm: flag only ['greedy']") for m in mismatches(choices, registries()))


def test_transfer_backends_resolve_to_their_classes():
    from moeserve.disagg.transfer.registry import backend_class

    assert backend_class("zmq").__name__ == args_module.TRANSFER_BACKENDS["zmq"][1]


@pytest.mark.parametrize("mode", [r.value for r in PDRole])
def test_pd_options_read_every_pd_flag(mode):
    pd = ServerArgs(disaggregation_mode=mode).disagg
    assert (pd.enabled, pd.is_prefill, pd.is_decode) == (mode != "null", mode == "prefill", mode == "decode")
    names = {f.name for f in dataclasses.fields(PDOptions)} - {"role"}
    assert names == {k.removeprefix("disaggregation_") for k in PD_ONLY_DEFAULTS}
