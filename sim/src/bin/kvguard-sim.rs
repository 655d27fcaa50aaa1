//! `scripts/sim`: seed campaigns and timelines.
//!
//! ```text
//! kvguard-sim --seeds N [--from S]   run seeds S..S+N; shrink and print the first unknown violation
//! kvguard-sim --seed S               print seed S's schedule, violations and their timelines
//! kvguard-sim --shrink S             shrink seed S's first violation; print the schedule as Rust
//! kvguard-sim --finding 36.1         print a known or fixed finding's schedule and timeline
//!                                    (a fixed one with the mechanism that fixed it --off)
//! kvguard-sim --findings             list the known findings and whether each is still found
//! kvguard-sim --guards               run the schedules that fail when a rule of the filter core is removed
//! kvguard-sim --witness NAME        a mechanism's witness, with everything on, then with it off
//! kvguard-sim --fleet 1x1,10x10      fleets of G gateways x R replicas: messages per replica per second, abort latency
//!                                    (--per-gateway N streams, default 20; --no-loss: no zone lost; --seed S;
//!                                    --pd: half the replicas prefill, half decode; --lose-replica: replica 0
//!                                    lost at 2 minutes)
//! kvguard-sim --ablate [--seeds N]   run N seeds (default 1000) with each mechanism off in turn; print the table
//! ```
//! `--off NAME` (repeatable; `--no-deferral` is `--off deferral`) runs with a mechanism
//! switched off ([`kvguard_sim::ablation`], `--ablate` lists the names).

use kvguard_sim::ablation::{self, Mechanism};
use kvguard_sim::findings::{known, regressions};
use kvguard_sim::shrink::shrink;
use kvguard_sim::{run, Mutations, Report, Schedule};
use std::collections::BTreeMap;
use std::process::ExitCode;

fn arg(args: &[String], name: &str) -> Option<u64> {
    let i = args.iter().position(|a| a == name)?;
    args.get(i + 1)?.parse().ok()
}

fn print_report(sched: &Schedule, r: &Report) {
    print!("{sched}");
    for v in &r.violations {
        println!("\n{v}\n{}", r.timeline.story(v.stream));
    }
    if r.violations.is_empty() {
        println!("\nno violation\n{}", r.timeline.story(usize::MAX));
        for i in 0..r.streams {
            println!("stream {i}:\n{}", r.timeline.story_of(i));
        }
    }
}

/// `--fleet GxR[,GxR...] [--per-gateway N] [--no-loss] [--seed S]`: one table row per size.
fn fleet(args: &[String], sizes: &str) -> ExitCode {
    let mut fleets = Vec::new();
    for size in sizes.split(',') {
        let Some((g, r)) = size
            .split_once('x')
            .and_then(|(g, r)| Some((g.parse().ok()?, r.parse().ok()?)))
        else {
            eprintln!(
                "--fleet {size}: expected GxR (gateways x replicas, each 1 to 255), e.g. 10x10"
            );
            return ExitCode::FAILURE;
        };
        fleets.push(kvguard_sim::fleet::Fleet {
            gateways: g,
            replicas: r,
            per_gateway: arg(args, "--per-gateway").unwrap_or(20) as u32,
            zone_lost: !args.iter().any(|a| a == "--no-loss"),
            pd: args.iter().any(|a| a == "--pd"),
            replica_lost: args.iter().any(|a| a == "--lose-replica"),
            seed: arg(args, "--seed").unwrap_or(1),
        });
    }
    println!("{}", kvguard_sim::fleet::TABLE_HEAD);
    let mut unknown = 0;
    for f in &fleets {
        let r = kvguard_sim::fleet::run(f);
        unknown += r.violations.1;
        println!("{r}");
    }
    if unknown > 0 {
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut m = Mutations::default();
    for (i, a) in args.iter().enumerate() {
        let name = match a.as_str() {
            "--no-deferral" => "deferral",
            "--off" => args.get(i + 1).map_or("", String::as_str),
            _ => continue,
        };
        let Some(mech) = Mechanism::parse(name) else {
            let names: Vec<_> = ablation::ALL.iter().map(|m| m.name()).collect();
            eprintln!(
                "--off {name}: no such mechanism (one of {})",
                names.join(", ")
            );
            return ExitCode::FAILURE;
        };
        m = m.without(mech);
    }
    if let Some(i) = args.iter().position(|a| a == "--witness") {
        let name = args.get(i + 1).map_or("", String::as_str);
        let Some((mech, (promise, s))) =
            Mechanism::parse(name).and_then(|mech| Some((mech, mech.witness()?)))
        else {
            eprintln!("no witness for {name}");
            return ExitCode::FAILURE;
        };
        println!("witness of {name}: breaks {promise:?} with it off\n\n--- everything on:");
        print_report(&s, &run(&s, Mutations::default()));
        println!("\n--- {name} off:");
        print_report(&s, &run(&s, Mutations::default().without(mech)));
        return ExitCode::SUCCESS;
    }
    if let Some(i) = args.iter().position(|a| a == "--fleet") {
        return fleet(&args, args.get(i + 1).map_or("", String::as_str));
    }
    if args.iter().any(|a| a == "--ablate") {
        let n = arg(&args, "--seeds").unwrap_or(1000);
        let from = arg(&args, "--from").unwrap_or(0);
        let threads = std::thread::available_parallelism().map_or(1, usize::from);
        let rows = ablation::ablate(from..from + n, &ablation::ALL, threads);
        print!("{}", ablation::table(n, &ablation::ALL, &rows));
        let witnesses_hold = rows.iter().all(|r| r.witness != Some(false));
        return if witnesses_hold {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    if let Some(seed) = arg(&args, "--seed") {
        let s = Schedule::generate(seed);
        print_report(&s, &run(&s, m));
        return ExitCode::SUCCESS;
    }
    if let Some(seed) = arg(&args, "--shrink") {
        let s = Schedule::generate(seed);
        let r = run(&s, m);
        let Some(v) = r.violations.first() else {
            println!("seed {seed}: no violation");
            return ExitCode::SUCCESS;
        };
        println!("seed {seed}: {v}\nshrunk:");
        let small = shrink(&s, m, v);
        println!("{small:#?}");
        print_report(&small, &run(&small, m));
        return ExitCode::SUCCESS;
    }
    if let Some(i) = args.iter().position(|a| a == "--finding") {
        let name = args.get(i + 1).map(String::as_str).unwrap_or("");
        let Some(f) = known()
            .into_iter()
            .chain(regressions())
            .find(|f| f.name == name)
        else {
            eprintln!("no known or fixed finding {name}");
            return ExitCode::FAILURE;
        };
        println!("finding {}: {}", f.name, f.title);
        print_report(&f.schedule, &run(&f.schedule, m));
        return ExitCode::SUCCESS;
    }
    if args.iter().any(|a| a == "--guards") {
        let mut ok = true;
        for g in kvguard_sim::findings::guards() {
            let r = run(&g.schedule, m);
            ok &= r.violations.is_empty();
            println!(
                "{}: {}",
                g.rule,
                if r.violations.is_empty() {
                    "passes".to_owned()
                } else {
                    format!(
                        "FAILS\n{}",
                        r.violations
                            .iter()
                            .map(|v| format!("  {v}\n{}", r.timeline.story(v.stream)))
                            .collect::<String>()
                    )
                }
            );
        }
        return if ok {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    if args.iter().any(|a| a == "--findings") {
        for f in known() {
            let r = run(&f.schedule, m);
            let found = r.violations.iter().any(|v| v.finding == Some(f.name));
            println!(
                "{} {}: {}",
                f.name,
                if found { "FOUND" } else { "not found" },
                f.title
            );
        }
        return ExitCode::SUCCESS;
    }
    let n = arg(&args, "--seeds").unwrap_or(1000);
    let from = arg(&args, "--from").unwrap_or(0);
    let mut per: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let (mut sim_ms, mut streams) = (0u64, 0usize);
    let mut first_unknown = None;
    for seed in from..from + n {
        let s = Schedule::generate(seed);
        let r = run(&s, m);
        sim_ms += r.simulated_ms;
        streams += r.streams;
        for v in &r.violations {
            let key = v
                .finding
                .map_or("unknown".to_owned(), |f| format!("finding {f}"));
            let e = per.entry(key).or_insert((0, seed));
            e.0 += 1;
            if v.finding.is_none() && args.iter().any(|a| a == "--list") {
                println!("seed {seed}: {v}");
            }
            if v.finding.is_none() && first_unknown.is_none() {
                first_unknown = Some((s.clone(), v.clone()));
            }
        }
    }
    println!(
        "{n} seeds from {from}: {streams} streams, {:.1} simulated hours",
        sim_ms as f64 / 3_600_000.0
    );
    for (k, (count, seed)) in &per {
        println!("  {k}: {count} violation(s), first at seed {seed}");
    }
    if let Some((s, v)) = first_unknown {
        println!("\nfirst unknown violation (seed {}): {v}\nshrunk:", s.seed);
        let small = shrink(&s, m, &v);
        print_report(&small, &run(&small, m));
        return ExitCode::FAILURE;
    }
    println!("0 unknown violations");
    ExitCode::SUCCESS
}
