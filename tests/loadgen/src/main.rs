//! A steady transaction load on a Solana node, from the real client
//! library (`solana-rpc-client`, the SDK's transaction types, the SPL
//! Memo and Token interfaces): system transfers, Memo calls and SPL Token
//! `transfer_checked`s in turn, at an offered rate, for a time.
//!
//! `loadgen --url http://127.0.0.1:8899 --rate 50 --seconds 60 [--report FILE]`
//!
//! Set-up (airdrop, a mint, two token accounts, recipients) is confirmed
//! before the load starts. Each transaction is sent once, without
//! preflight, paced by the clock (a send that takes longer does not slow
//! the offered rate: sends run concurrently). At the end every signature's
//! status is asked: landed (the node has it), confirmed, failed. The
//! report (stdout, and FILE as JSON) says the rate reached and those
//! counts, so a test knows what load it really ran.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use solana_commitment_config::CommitmentConfig;
use solana_hash::Hash;
use solana_keypair::Keypair;
use solana_message::Message;
use solana_pubkey::Pubkey;
use solana_rpc_client::nonblocking::rpc_client::RpcClient;
use solana_rpc_client_api::config::RpcSendTransactionConfig;
use solana_signature::Signature;
use solana_signer::Signer;
use solana_transaction::Transaction;

const LAMPORTS_PER_SOL: u64 = 1_000_000_000;
const MINT_LEN: u64 = 82;
const TOKEN_ACCOUNT_LEN: u64 = 165;
const DECIMALS: u8 = 6;
const RECIPIENTS: usize = 8;

struct Args {
    url: String,
    rate: f64,
    seconds: f64,
    report: Option<String>,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        url: "http://127.0.0.1:8899".into(),
        rate: 50.0,
        seconds: 60.0,
        report: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} wants a value"));
        match flag.as_str() {
            "--url" => a.url = value()?,
            "--rate" => a.rate = value()?.parse().map_err(|e| format!("--rate: {e}"))?,
            "--seconds" => a.seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--report" => a.report = Some(value()?),
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: loadgen --url URL --rate TX_PER_S --seconds S [--report FILE]"
                ))
            }
        }
    }
    if !(a.rate > 0.0 && a.rate <= 10_000.0) || !(a.seconds > 0.0) {
        return Err("--rate wants 0 < N <= 10000 and --seconds a positive number".into());
    }
    Ok(a)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("loadgen: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args).await {
        eprintln!("loadgen: {e}");
        std::process::exit(1);
    }
}

async fn confirm(
    rpc: &RpcClient,
    payer: &Keypair,
    ixs: &[solana_instruction::Instruction],
    extra: &[&Keypair],
) -> Result<(), String> {
    let hash = rpc
        .get_latest_blockhash()
        .await
        .map_err(|e| format!("getLatestBlockhash: {e}"))?;
    let mut signers: Vec<&Keypair> = vec![payer];
    signers.extend_from_slice(extra);
    let tx = Transaction::new_signed_with_payer(ixs, Some(&payer.pubkey()), &signers, hash);
    rpc.send_and_confirm_transaction(&tx)
        .await
        .map(|_| ())
        .map_err(|e| format!("set-up transaction: {e}"))
}

async fn run(args: Args) -> Result<(), String> {
    let rpc = Arc::new(RpcClient::new_with_commitment(
        args.url.clone(),
        CommitmentConfig::confirmed(),
    ));
    let payer = Arc::new(Keypair::new());

    // Funds: one airdrop, waited for.
    let sig = rpc
        .request_airdrop(&payer.pubkey(), 1_000 * LAMPORTS_PER_SOL)
        .await
        .map_err(|e| {
            format!(
                "requestAirdrop at {}: {e} (is the node up, with its faucet?)",
                args.url
            )
        })?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if rpc.confirm_transaction(&sig).await.unwrap_or(false) {
            break;
        }
        if Instant::now() > deadline {
            return Err("the airdrop was not confirmed within 60 s".into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A mint and two token accounts, the source holding the supply.
    let token = spl_token_interface::id();
    let mint = Keypair::new();
    let (src, dst) = (Keypair::new(), Keypair::new());
    let rent = |len| {
        let rpc = rpc.clone();
        async move {
            rpc.get_minimum_balance_for_rent_exemption(len as usize)
                .await
                .map_err(|e| format!("getMinimumBalanceForRentExemption: {e}"))
        }
    };
    let (mint_rent, account_rent) = (rent(MINT_LEN).await?, rent(TOKEN_ACCOUNT_LEN).await?);
    let p = payer.pubkey();
    let mut ixs = vec![
        solana_system_interface::instruction::create_account(&p, &mint.pubkey(), mint_rent, MINT_LEN, &token),
        spl_token_interface::instruction::initialize_mint2(&token, &mint.pubkey(), &p, None, DECIMALS)
            .map_err(|e| e.to_string())?,
    ];
    for a in [&src, &dst] {
        ixs.push(solana_system_interface::instruction::create_account(
            &p,
            &a.pubkey(),
            account_rent,
            TOKEN_ACCOUNT_LEN,
            &token,
        ));
        ixs.push(
            spl_token_interface::instruction::initialize_account3(&token, &a.pubkey(), &mint.pubkey(), &p)
                .map_err(|e| e.to_string())?,
        );
    }
    ixs.push(
        spl_token_interface::instruction::mint_to(
            &token,
            &mint.pubkey(),
            &src.pubkey(),
            &p,
            &[],
            u64::MAX / 2,
        )
        .map_err(|e| e.to_string())?,
    );
    confirm(&rpc, &payer, &ixs, &[&mint, &src, &dst]).await?;

    // Recipients made rent-exempt, so later small transfers land.
    let recipients: Vec<Pubkey> = (0..RECIPIENTS).map(|_| Pubkey::new_unique()).collect();
    let ixs: Vec<_> = recipients
        .iter()
        .map(|r| solana_system_interface::instruction::transfer(&p, r, LAMPORTS_PER_SOL))
        .collect();
    confirm(&rpc, &payer, &ixs, &[]).await?;

    // The blockhash, refreshed every second in the background.
    let hash = Arc::new(Mutex::new(
        rpc.get_latest_blockhash()
            .await
            .map_err(|e| format!("getLatestBlockhash: {e}"))?,
    ));
    let refresher = {
        let (rpc, hash) = (rpc.clone(), hash.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                if let Ok(h) = rpc.get_latest_blockhash().await {
                    *hash.lock().unwrap() = h;
                }
            }
        })
    };

    // The load: one transaction every 1/rate s, by the clock.
    let memo = spl_memo_interface::v3::id();
    let period = Duration::from_secs_f64(1.0 / args.rate);
    let started = Instant::now();
    let end = started + Duration::from_secs_f64(args.seconds);
    let mut next = tokio::time::Instant::now();
    let mut sends = Vec::new();
    let mut kinds = [0u64; 3];
    let mut i: u64 = 0;
    // SIGTERM or SIGINT ends the offering early; the report still follows.
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(|e| format!("SIGINT handler: {e}"))?;
    while Instant::now() < end {
        tokio::select! {
            _ = tokio::time::sleep_until(next) => {}
            _ = term.recv() => break,
            _ = int.recv() => break,
        }
        next += period;
        let kind = (i % 3) as usize;
        let ix = match kind {
            0 => solana_system_interface::instruction::transfer(
                &p,
                &recipients[i as usize % RECIPIENTS],
                1_000 + i,
            ),
            1 => spl_memo_interface::instruction::build_memo(
                &memo,
                format!("slotprof load {i}").as_bytes(),
                &[&p],
            ),
            _ => spl_token_interface::instruction::transfer_checked(
                &token,
                &src.pubkey(),
                &mint.pubkey(),
                &dst.pubkey(),
                &p,
                &[],
                1 + i,
                DECIMALS,
            )
            .map_err(|e| e.to_string())?,
        };
        kinds[kind] += 1;
        i += 1;
        let blockhash: Hash = *hash.lock().unwrap();
        let tx = Transaction::new(&[payer.as_ref()], Message::new(&[ix], Some(&p)), blockhash);
        let rpc = rpc.clone();
        sends.push(tokio::spawn(async move {
            let config = RpcSendTransactionConfig {
                skip_preflight: true,
                max_retries: Some(0),
                ..Default::default()
            };
            rpc.send_transaction_with_config(&tx, config).await
        }));
    }
    let offered_for = started.elapsed().as_secs_f64();
    refresher.abort();
    let mut sent: Vec<Signature> = Vec::new();
    let mut send_errors = 0u64;
    let mut first_error = None;
    for s in sends {
        match s.await {
            Ok(Ok(sig)) => sent.push(sig),
            Ok(Err(e)) => {
                send_errors += 1;
                first_error.get_or_insert(e.to_string());
            }
            Err(e) => {
                send_errors += 1;
                first_error.get_or_insert(e.to_string());
            }
        }
    }

    // Statuses: wait while more land (up to 20 s), then count.
    let settle = Instant::now() + Duration::from_secs(20);
    let (landed, confirmed, failed) = loop {
        let (mut l, mut c, mut f) = (0u64, 0u64, 0u64);
        for chunk in sent.chunks(256) {
            let statuses = rpc
                .get_signature_statuses_with_history(chunk)
                .await
                .map_err(|e| format!("getSignatureStatuses: {e}"))?
                .value;
            for s in statuses.into_iter().flatten() {
                l += 1;
                if s.err.is_some() {
                    f += 1;
                } else if s.satisfies_commitment(CommitmentConfig::confirmed()) {
                    c += 1;
                }
            }
        }
        if c + f == sent.len() as u64 || Instant::now() > settle {
            break (l, c, f);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let report = serde_json::json!({
        "offered_rate": args.rate,
        "seconds": (offered_for * 1000.0).round() / 1000.0,
        "offered": i,
        "sent": sent.len(),
        "send_errors": send_errors,
        "first_send_error": first_error,
        "reached_rate": ((sent.len() as f64 / offered_for) * 100.0).round() / 100.0,
        "landed": landed,
        "confirmed": confirmed,
        "failed": failed,
        "transfers": kinds[0],
        "memos": kinds[1],
        "token_transfers": kinds[2],
    })
    .to_string();
    println!("{report}");
    if let Some(path) = &args.report {
        std::fs::write(path, format!("{report}\n")).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}
