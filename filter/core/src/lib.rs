//! Host-free logic of the kvguard filter (placeholder).
