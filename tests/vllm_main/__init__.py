"""Facts of vllm-omni **main** (commit d6240742, 2026-07-24, fork vraiti/vllm-omni), re-expressed for our tests.

Nothing here is vllm-omni's code. ``deploy/`` holds the connector-relevant
part of main's deploy YAMLs (data, extracted by ``extract_deploy.py``);
``main_loader`` re-states how main's loader turns them into connector
``extra`` dicts; ``stand_ins`` re-states the call patterns of main's
scheduler chunk adapter and model-runner connector mixin; ``stage_proc`` is
one stage process of the three-stage pipeline test.
"""
