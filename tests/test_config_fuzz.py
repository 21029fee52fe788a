"""Property-based fuzzing of the config loaders (hypothesis): whatever the input, a config or ConfigError.

Random values of every JSON/YAML shape in the keys of a ZmqConnector ``extra``
dict, a connector spec, a vllm-omni stage config (``runtime`` / ``stage_args``)
and a pipeline file: a loader either returns a config or raises ``ConfigError``
(which names the key), never another exception. Derandomized, 2000 cases.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmq_omni.config.pipeline import ConnectorSpec, load_omni_transfer_config
from zmq_omni.config.zmq import ZmqConnectorConfig
from zmq_omni.errors import ConfigError
from zmq_omni.stages import load_pipeline_config

FUZZ = settings(
    max_examples=400, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)

ZMQ_KEYS = [
    "stage_id", "role", "endpoints", "mode", "put_timeout_s", "delivery_timeout_s", "heartbeat_s",
    "peer_timeout_s", "max_unacked", "max_unacked_bytes", "max_message_bytes", "hwm", "batch_max_messages",
    "batch_max_bytes", "pull_ttl_s", "fetch_timeout_s", "copy_on_put", "inline_threshold", "shm",
    "shm_threshold", "shm_dir", "allow_pickle", "bind", "curve_secret_key", "curve_public_key",
    "curve_server_key", "curve_allowed_clients", "close_timeout_s", "malloc_tuning", "shm_ttl_s",
    "shm_pool_max_bytes", "shm_min_free_bytes", "not_a_key",
]  # fmt: skip

# Plausible words mixed with every scalar and container shape YAML can produce.
WORDS = ["push", "pull", "sender", "receiver", "dual", "auto", "on", "off", "0", "1", "tcp://127.0.0.1:0", "ipc:///x"]
values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=30),
        st.sampled_from(WORDS),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=3)
    ),
    max_leaves=6,
)
stage_ids = st.one_of(st.integers(-2, 5), st.sampled_from(["0", "1", "2", "thinker"]), values)
edge_keys = st.one_of(
    st.sampled_from(["from_stage_0", "from_stage_1", "to_stage_1", "to_stage_2", "from_stage_", "to_stage_x"]),
    st.text(max_size=8),
)
connector_refs = st.one_of(
    st.sampled_from(["a", "b", "missing"]),
    values,
    st.fixed_dictionaries(
        {"name": st.sampled_from(["ZmqConnector", "SharedMemoryConnector", "NoSuchConnector"]), "extra": values}
    ),
)
stage_args = st.dictionaries(
    st.sampled_from(["stage_id", "input_connectors", "output_connectors", "engine_input_source", "other"]),
    st.one_of(stage_ids, st.dictionaries(edge_keys, connector_refs, max_size=3), st.lists(stage_ids, max_size=3)),
    max_size=4,
)
stage_configs = st.fixed_dictionaries(
    {
        "runtime": st.one_of(
            values,
            st.fixed_dictionaries(
                {
                    "connectors": st.one_of(values, st.dictionaries(st.sampled_from(["a", "b"]), connector_refs)),
                    "default_connector": connector_refs,
                    "edges": st.one_of(
                        values, st.lists(st.dictionaries(st.sampled_from(["from", "to"]), stage_ids), max_size=3)
                    ),
                }
            ),
        ),
        "stage_args": st.one_of(values, st.lists(stage_args, max_size=4)),
    }
)
pipeline_stages = st.dictionaries(
    st.sampled_from(["name", "stage_id", "function", "endpoint", "bind", "params", "other"]),
    st.one_of(
        st.sampled_from(["thinker", "talker", "zmq_omni.cli.demo_stages:thinker", "tcp://127.0.0.1:5555", "0"]), values
    ),
    max_size=6,
)
pipeline_files = st.fixed_dictionaries(
    {
        "pipeline": st.one_of(
            values,
            st.dictionaries(
                st.sampled_from(["stages", "driver", "name", "other"]),
                st.one_of(values, st.lists(pipeline_stages, max_size=3)),
                max_size=3,
            ),
        )
    }
)


@FUZZ
@given(extra=st.dictionaries(st.sampled_from(ZMQ_KEYS), values, max_size=8))
def test_zmq_connector_extra_dicts_load_or_raise_config_error(extra: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        ZmqConnectorConfig.from_dict(extra)


@FUZZ
@given(spec=values)
def test_connector_specs_load_or_raise_config_error(spec: Any) -> None:
    with contextlib.suppress(ConfigError):
        ConnectorSpec.from_dict(spec)


@FUZZ
@given(document=st.one_of(stage_configs, st.dictionaries(st.sampled_from(["runtime", "stage_args", "x"]), values)))
def test_vllm_omni_stage_configs_load_or_raise_config_error(document: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        load_omni_transfer_config(document)


@settings(FUZZ, max_examples=800)
@given(document=pipeline_files)
def test_pipeline_files_load_or_raise_config_error(document: dict[str, Any]) -> None:
    with contextlib.suppress(ConfigError):
        load_pipeline_config(document, environ={})
