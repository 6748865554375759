"""The resident HTTP daemon: an OpenAI-compatible server over one decode session.

- `config.ServeConfig`: options, with the loopback-unless-keyed rule;
- `server.serve(config)`: load, then run on uvicorn (`BackgroundServer`: the same on a thread);
- `engine.Engine`: warm-up, the FIFO queue and the one worker thread that owns the accelerator;
- `slots.SlotManager`: the KV slots a request runs in, spilled to host memory (`kv_state`) and
  saved to disk (`slot_files`); how many fit is `runtime.state_budget` (doctor uses it too);
- `draft_scopes`: `--draft-memory`, which earlier requests a request may draft from;
- `app.create_app`: routes, auth, limits, OpenAI error shapes;
- `launchd.install_launch_agent`: the macOS LaunchAgent for `ane-spec daemon install`.

Only `ane_spec.cli` imports this package; it imports the decode engine (and, to load a build,
the manifests, runtime and probes) but nothing imports it back.
"""
