"""The files calm writes and reads: the calibration adapter (``artifact``), the engine
manifest (``engine``), how an adapter was fitted (``fit_record``), and the strict checks
every manifest, tensor file and model config goes through on load (docs/formats.md)."""
