//! kvguard proxy-wasm glue (placeholder).
