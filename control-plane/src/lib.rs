//! The sluice controller: it keeps one session open to every stage, turns
//! the operators' policies into per-stage settings, pushes them with
//! increasing versions and records which version each stage runs.
//!
//! [`store`] is its durable state (SQLite by default, Postgres to scale
//! out): policy revisions, stages, jobs, settings versions and events.

pub mod store;
