//! The `kvguard-control` binary.
#![forbid(unsafe_code)]

use clap::error::ErrorKind;
use clap::Parser;
use kvguard_control::config::{LogFormat, SECRET_ENV};
use kvguard_control::{Args, Config, Deps, Server, EXIT_USAGE};
use std::process::ExitCode;

fn main() -> ExitCode {
    // First: a SIGHUP (a reload request, or a terminal's hang-up) never ends the process,
    // not even during start-up.
    let hup = kvguard_control::keys::install_hangup_handler();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let code = match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => 0,
                _ => EXIT_USAGE,
            };
            let _ = e.print();
            return ExitCode::from(code as u8);
        }
    };
    let secret = std::env::var_os(SECRET_ENV).map(|s| s.into_encoded_bytes());
    let cfg = match Config::try_new(args, secret) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvguard-control: {e}");
            return ExitCode::from(EXIT_USAGE as u8);
        }
    };
    init_tracing(&cfg);
    if let Err(e) = hup {
        tracing::warn!(error = %e, "cannot install the SIGHUP handler: a SIGHUP ends the process");
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.worker_threads)
        .thread_name("kvguard-control")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvguard-control: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let deps = Deps::real(&cfg);
        let server = match Server::start(cfg, deps).await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("cannot start: {e}");
                eprintln!("kvguard-control: {e}");
                return ExitCode::FAILURE;
            }
        };
        let sig = wait_for_signal().await;
        tracing::info!(signal = sig, "signal received");
        tokio::spawn(async {
            let sig = wait_for_signal().await;
            tracing::warn!(signal = sig, "second signal: exiting at once");
            std::process::exit(130);
        });
        server.stop().await;
        ExitCode::SUCCESS
    })
}

fn init_tracing(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match cfg.log_format {
        LogFormat::Json => b.json().flatten_event(true).try_init(),
        LogFormat::Text => b.with_ansi(false).try_init(),
    };
}

async fn wait_for_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut t), Ok(mut i)) => tokio::select! {
            _ = t.recv() => "SIGTERM",
            _ = i.recv() => "SIGINT",
        },
        _ => {
            let _ = tokio::signal::ctrl_c().await;
            "SIGINT"
        }
    }
}
