"""The runtime: devices and dtypes, loading models and heads and their files, the demo model, per-machine
calibration and the choice it drives, exports, chat templates, prompt files, and how commands report errors
and write their outputs. It builds on the engine (inference.engine), never on a command line."""
