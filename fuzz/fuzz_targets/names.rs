//! Names and keys: event names, idempotency keys, step names and function ids
//! of any content and length, and function definitions through
//! `EngineBuilder::build`, which must refuse a bad id or trigger before it
//! connects (the builder here has no database at all).
#![no_main]

use arbitrary::Arbitrary;
use durastep::limits::{self, LimitError, Limits};
use durastep::{Engine, Error, Event, Function};
use durastep_fuzz::name_ok;
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    max_key_bytes: u16,
    name: &'a str,
    trigger: &'a str,
}

fn check_refusal(result: Result<(), LimitError>, what: &str, should_pass: bool) {
    match result {
        Ok(()) => assert!(should_pass, "{what} wrongly accepted"),
        Err(LimitError::InvalidName { what: w, value, .. }) => {
            assert!(!should_pass, "{what} wrongly refused");
            assert_eq!(w, what);
            assert!(value.chars().count() <= 80);
        }
        Err(other) => panic!("{what}: unexpected refusal {other:?}"),
    }
}

fuzz_target!(|input: Input<'_>| {
    let limits = Limits { max_key_bytes: usize::from(input.max_key_bytes), ..Limits::default() };
    let name = input.name;
    let base = name_ok(name, limits.max_key_bytes);

    check_refusal(limits::check_name("event name", name, &limits), "event name", base);
    check_refusal(limits::check_step_name(name, &limits), "step name", base && !name.contains('#'));
    let id_ok = base && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c));
    check_refusal(limits::check_function_id(name, &limits), "function id", id_ok);

    // Accepted names can be stored in Postgres text (no NUL).
    if base {
        assert!(!name.contains('\0'));
    }

    // Through the event API: as event name, then as idempotency key.
    let as_name = Event::new(name, &()).validate(&limits);
    check_refusal(as_name, "event name", base);
    let as_key = Event::new("e", &()).idempotency_key(name).validate(&limits);
    if name_ok("e", limits.max_key_bytes) {
        check_refusal(as_key, "idempotency key", base);
    } else {
        check_refusal(as_key, "event name", false);
    }

    // Through the builder: a bad id or trigger is refused before connecting;
    // a good one gets as far as "no database".
    let trigger_ok = name_ok(input.trigger, limits.max_key_bytes);
    let f = Function::new(name).on_event(input.trigger).handler(|_ctx, _x: ()| async { Ok(()) });
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let built = rt.block_on(Engine::builder().limits(limits).function(f).build());
    match built {
        Err(Error::NoDatabase) => assert!(id_ok && trigger_ok, "bad function definition got past validation"),
        Err(Error::Limit(LimitError::InvalidName { what, .. })) => {
            assert!(!(id_ok && trigger_ok), "good function definition refused");
            assert_eq!(what, if id_ok { "event name" } else { "function id" });
        }
        Err(other) => panic!("unexpected build error {other}"),
        Ok(_) => panic!("built an engine without a database"),
    }
});
