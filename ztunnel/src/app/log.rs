//! Logging for both binaries: Istio's line shapes (`crate::logging`) on stderr, text or
//! JSON, with a filter the admin endpoint can change at run time.

use std::sync::Mutex;

use tracing_subscriber::prelude::*;
use tracing_subscriber::{reload, EnvFilter, Registry};

/// The log filter, replaceable at run time through the admin endpoint.
pub struct ReloadableLog {
    handle: reload::Handle<EnvFilter, Registry>,
    current: Mutex<String>,
    initial: String,
}

impl crate::admin::LogControl for ReloadableLog {
    fn get(&self) -> String {
        self.current.lock().map(|c| c.clone()).unwrap_or_default()
    }

    fn initial(&self) -> String {
        self.initial.clone()
    }

    fn set(&self, filter: &str) -> Result<(), String> {
        let parsed = EnvFilter::try_new(filter).map_err(|e| e.to_string())?;
        self.handle.reload(parsed).map_err(|e| e.to_string())?;
        if let Ok(mut c) = self.current.lock() {
            *c = filter.to_string();
        }
        Ok(())
    }
}

/// Installs the global subscriber: `RUST_LOG` (default `info`) as the filter, `format`
/// `json` for Istio's JSON lines, anything else for its text lines.
pub fn init_logging(format: &str) -> ReloadableLog {
    let initial = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    let filter = EnvFilter::try_new(&initial).unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    // Each after the fmt layer: see `CompactSpanFields`.
    if format == "json" {
        use tracing_subscriber::fmt::format::JsonFields;
        let fmt = fmt
            .event_format(crate::logging::IstioJson)
            .fmt_fields(JsonFields::new());
        let compact = crate::logging::CompactSpanFields::<JsonFields>::default();
        tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .with(compact)
            .init();
    } else {
        let compact = crate::logging::CompactSpanFields::<
            tracing_subscriber::fmt::format::DefaultFields,
        >::default();
        tracing_subscriber::registry()
            .with(filter)
            .with(fmt.event_format(crate::logging::IstioText))
            .with(compact)
            .init();
    }
    ReloadableLog {
        handle,
        current: Mutex::new(initial.clone()),
        initial,
    }
}
