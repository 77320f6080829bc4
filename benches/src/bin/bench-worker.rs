//! A worker process for the multi-process benches: registers the bench
//! functions, prints `ready`, starts working on `go`, stops when stdin closes.
//!
//! `bench-worker <database-url> [in_flight=N] [writers=N] [claim_batch=N] [claim_ahead=N] [pool=N] [listen=bool] [flow=bool]`

use durastep::Engine;
use durastep_benches::process::WorkerConfig;
use tokio::io::{AsyncBufReadExt, BufReader};

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let url = args.next().expect("usage: bench-worker <database-url> [key=value ...]");
    let config = WorkerConfig::from_args(args);
    let mut builder = Engine::builder()
        .database_url(url)
        .max_connections(config.pool)
        .migrate(false)
        .worker_options(config.options());
    for f in durastep_benches::functions::all() {
        builder = builder.function(f);
    }
    if config.flow {
        builder = builder.function(durastep_benches::functions::flowed());
    }
    let engine = builder.build().await.expect("build engine");
    println!("ready");

    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    let mut worker = None;
    while let Ok(Some(line)) = lines.next_line().await {
        if line.trim() == "go" && worker.is_none() {
            worker = Some(engine.spawn_worker());
        }
    }
    if let Some(w) = worker {
        w.stop().await.expect("worker");
    }
}
