//! Log lines in Istio ztunnel's shape, for ztunnel and the waypoint alike:
//! text `time<TAB>level<TAB>scope[:span{fields}...]<TAB>message<TAB>k=v ...`, or (LOG_FORMAT=json)
//! one object per line with `level`, `time`, `scope`, `message`, the event's fields, and
//! one entry per span. The scope is the event's target without the `ztunnel::` prefix;
//! connection lines use the target `access`, as upstream's.

use std::fmt::Write as _;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The scope Istio prints for a target.
pub fn scope(target: &str) -> &str {
    target.strip_prefix("ztunnel::").unwrap_or(target)
}

/// Text lines (see the module docs).
#[derive(Clone, Copy, Debug, Default)]
pub struct IstioText;

/// The event's message, and its other fields as `k=v` (values in Debug form: strings
/// quoted, Display values bare), space separated.
#[derive(Default)]
struct TextFields {
    message: String,
    fields: String,
}

impl Visit for TextFields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else if !field.name().starts_with("log.") {
            if !self.fields.is_empty() {
                self.fields.push(' ');
            }
            let _ = write!(self.fields, "{}={value:?}", field.name());
        }
    }
}

impl<S, N> FormatEvent<S, N> for IstioText
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        SystemTime.format_time(&mut w)?;
        write!(
            w,
            "\t{}\t{}",
            meta.level().as_str().to_ascii_lowercase(),
            scope(meta.target())
        )?;
        if let Some(spans) = ctx.event_scope() {
            for span in spans.from_root() {
                write!(w, ":{}", span.name())?;
                let ext = span.extensions();
                if let Some(fields) = ext.get::<FormattedFields<N>>().filter(|f| !f.is_empty()) {
                    write!(w, "{{{fields}}}")?;
                }
            }
        }
        let mut v = TextFields::default();
        event.record(&mut v);
        write!(w, "\t{}", v.message)?;
        if !v.fields.is_empty() {
            write!(w, "\t{}", v.fields)?;
        }
        writeln!(w)
    }
}

/// JSON lines (see the module docs). Spans' fields must be formatted as JSON
/// (`tracing_subscriber::fmt::format::JsonFields`).
#[derive(Clone, Copy, Debug, Default)]
pub struct IstioJson;

struct JsonFields(Map<String, Value>);

impl Visit for JsonFields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_string(),
            Value::String(format!("{value:?}")),
        );
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0
            .insert(field.name().to_string(), Value::String(value.to_string()));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_string(), value.into());
    }
}

impl<S, N> FormatEvent<S, N> for IstioJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let meta = event.metadata();
        let mut time = String::with_capacity(32);
        SystemTime.format_time(&mut Writer::new(&mut time))?;
        let mut m = Map::new();
        m.insert(
            "level".into(),
            meta.level().as_str().to_ascii_lowercase().into(),
        );
        m.insert("time".into(), time.into());
        m.insert("scope".into(), scope(meta.target()).into());
        let mut fields = JsonFields(Map::new());
        event.record(&mut fields);
        m.extend(fields.0);
        if let Some(spans) = ctx.event_scope() {
            for span in spans.from_root() {
                let ext = span.extensions();
                let value = ext
                    .get::<FormattedFields<N>>()
                    .and_then(|f| serde_json::from_str::<Value>(f).ok())
                    .unwrap_or_else(|| Value::Object(Map::new()));
                m.insert(span.name().to_string(), value);
            }
        }
        let line = serde_json::to_string(&Value::Object(m)).map_err(|_| std::fmt::Error)?;
        writeln!(w, "{line}")
    }
}

/// Gives back the spare room of each span's formatted fields (`FormattedFields<N>`, the
/// fields formatter `N` the fmt layer uses) once the fmt layer has written them. Every
/// open connection has a span that lives as long as it does; its text grows by doubling
/// as fields are written (an outbound span's ~70 bytes of text sat in 128), and
/// nothing writes it again until a field is recorded. Install it after the fmt layer, so
/// it runs after it on each new span and record.
pub struct CompactSpanFields<N>(std::marker::PhantomData<fn(N)>);

impl<N> Default for CompactSpanFields<N> {
    fn default() -> Self {
        CompactSpanFields(std::marker::PhantomData)
    }
}

impl<N> CompactSpanFields<N> {
    fn compact<S: Subscriber + for<'a> LookupSpan<'a>>(
        id: &tracing::span::Id,
        ctx: &tracing_subscriber::layer::Context<'_, S>,
    ) where
        N: 'static,
    {
        if let Some(span) = ctx.span(id) {
            if let Some(f) = span.extensions_mut().get_mut::<FormattedFields<N>>() {
                f.fields.shrink_to_fit();
            }
        }
    }
}

impl<S, N> tracing_subscriber::Layer<S> for CompactSpanFields<N>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: 'static,
{
    fn on_new_span(
        &self,
        _: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        Self::compact(id, &ctx);
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        _: &tracing::span::Record<'_>,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        Self::compact(id, &ctx);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::fmt::MakeWriter;
    use tracing_subscriber::prelude::*;

    use super::*;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buf {
        type Writer = Buf;
        fn make_writer(&'a self) -> Buf {
            self.clone()
        }
    }

    fn emit() {
        let span = tracing::info_span!("inbound", src = %"10.0.0.1:4000");
        let _g = span.enter();
        tracing::info!(target: "access", bytes_sent = 10u64, src.identity = %"spiffe://cluster.local/ns/a/sa/b", response_flags = "DENY", "connection complete");
    }

    fn text(b: &Buf) -> String {
        String::from_utf8(b.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn text_lines_are_istios_tab_separated_shape() {
        let buf = Buf::default();
        let sub = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .event_format(IstioText)
                .with_writer(buf.clone())
                .with_ansi(false),
        );
        tracing::subscriber::with_default(sub, emit);
        let out = text(&buf);
        let cols: Vec<&str> = out.trim_end().split('\t').collect();
        assert_eq!(cols.len(), 5, "{out:?}");
        assert!(
            cols[0].ends_with('Z') && cols[0].contains('T'),
            "time: {out:?}"
        );
        assert_eq!(cols[1], "info");
        assert_eq!(cols[2], "access:inbound{src=10.0.0.1:4000}");
        assert_eq!(cols[3], "connection complete");
        assert_eq!(
            cols[4],
            "bytes_sent=10 src.identity=spiffe://cluster.local/ns/a/sa/b response_flags=\"DENY\""
        );
    }

    #[test]
    fn span_fields_keep_no_spare_room_and_stay_whole() {
        use tracing_subscriber::fmt::format::DefaultFields;
        let buf = Buf::default();
        let sub = tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .event_format(IstioText)
                    .with_writer(buf.clone())
                    .with_ansi(false),
            )
            .with(CompactSpanFields::<DefaultFields>::default());
        tracing::subscriber::with_default(sub, || {
            let span = tracing::info_span!("outbound", id = tracing::field::Empty, src = %"10.0.0.1:4000", pod = "client-7d9f");
            span.record("id", "0af7651916cd43dd8448eb211c80319c");
            let (len, capacity) = span
                .with_subscriber(|(id, dispatch)| {
                    let registry = dispatch
                        .downcast_ref::<tracing_subscriber::Registry>()
                        .expect("registry");
                    let data = registry.span(id).expect("span");
                    let ext = data.extensions();
                    let f = ext
                        .get::<FormattedFields<DefaultFields>>()
                        .expect("formatted fields");
                    (f.fields.len(), f.fields.capacity())
                })
                .expect("span enabled");
            assert_eq!(len, capacity, "spare room left in the span's text");
            let _g = span.enter();
            tracing::info!("connection complete");
        });
        let out = text(&buf);
        assert!(out.contains("outbound{src=10.0.0.1:4000 pod=\"client-7d9f\" id=\"0af7651916cd43dd8448eb211c80319c\"}"), "{out:?}");
    }

    #[test]
    fn json_lines_have_level_time_scope_and_fields() {
        let buf = Buf::default();
        let sub = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .event_format(IstioJson)
                .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                .with_writer(buf.clone())
                .with_ansi(false),
        );
        tracing::subscriber::with_default(sub, emit);
        let v: Value = serde_json::from_str(text(&buf).trim_end()).unwrap();
        assert_eq!(v["level"], "info");
        assert_eq!(v["scope"], "access");
        assert!(v["time"].as_str().is_some_and(|t| t.ends_with('Z')), "{v}");
        assert_eq!(v["message"], "connection complete");
        assert_eq!(v["src.identity"], "spiffe://cluster.local/ns/a/sa/b");
        assert_eq!(v["bytes_sent"], 10);
        assert_eq!(v["inbound"]["src"], "10.0.0.1:4000");
        assert_eq!(scope("ztunnel::xds::client"), "xds::client");
    }
}
