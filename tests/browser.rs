//! The report page in a real browser: headless Chromium (Debian's `chromium-headless-shell`
//! or `chromium`, which `.ci/run` installs; `LOCKSTEP_CHROMIUM` names another) renders the
//! default matrix's page and a small matrix's, and the tests look at what it shows: the
//! overview grid on the first screen, and a grid cell's link opening its detail with the
//! charts drawn. Where no Chromium is installed each test says so and passes without
//! checking anything. The screenshots are kept under `target/browser/` (a CI artifact).

use lockstep::harness::report::{read_report_or_baseline, render_html};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The headless Chromium to drive, if one is installed.
fn chromium() -> Option<PathBuf> {
    if let Some(named) = std::env::var_os("LOCKSTEP_CHROMIUM") {
        return Some(PathBuf::from(named));
    }
    let path = std::env::var_os("PATH")?;
    ["chromium-headless-shell", "chromium"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|p| p.is_file())
}

/// Runs the browser on `url` with `args` (headless, no sandbox: CI runs as root), bounded.
fn browse(browser: &Path, url: &str, args: &[&str]) -> std::process::Output {
    let out = Command::new("timeout")
        .arg("120")
        .arg(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
        ])
        .args(args)
        .arg(url)
        .output()
        .expect("start the browser");
    assert!(
        out.status.success(),
        "{} {url}: {}",
        browser.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Where this test's files go (kept after the run: the screenshots are artifacts).
fn artifacts(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/browser")
        .join(name);
    std::fs::create_dir_all(&dir).expect("artifact directory");
    dir
}

/// How many pixels of the PNG at `path` are exactly `rgb`, in its rows `0..rows`.
fn pixels_of(path: &Path, rgb: [u8; 3], rows: usize) -> usize {
    let file = std::fs::File::open(path).expect("screenshot");
    let mut decoder = png::Decoder::new(std::io::BufReader::new(file));
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buf = vec![0; reader.output_buffer_size().expect("size")];
    let info = reader.next_frame(&mut buf).expect("a frame");
    let channels = info.color_type.samples();
    buf[..info.buffer_size()]
        .chunks(info.line_size)
        .take(rows)
        .flat_map(|row| row.chunks(channels))
        .filter(|px| px[..3] == rgb)
        .count()
}

/// The default matrix's page (rendered from its baseline, tests/data/default-baseline.jsonl:
/// every comparison's verdict and margin): at 1280 × 900 the first screen shows the grid of
/// every world size, nearly every cell of it, and no detail.
#[test]
fn the_default_reports_first_screen_is_its_grid() {
    let Some(browser) = chromium() else {
        eprintln!("skipped: no headless Chromium (apt-get install chromium-headless-shell)");
        return;
    };
    let baseline = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/default-baseline.jsonl");
    let report = read_report_or_baseline(&baseline).expect("the default matrix's baseline");
    assert!(report.summary.comparisons > 1000, "{:?}", report.summary);
    let html = render_html(&report);
    let dir = artifacts("default");
    let page = dir.join("report.html");
    std::fs::write(&page, &html).expect("write the page");
    let shot = dir.join("first-screen.png");
    browse(
        &browser,
        &format!("file://{}", page.display()),
        &[
            "--window-size=1280,900",
            &format!("--screenshot={}", shot.display()),
        ],
    );
    // #2e7d32 is a passing cell's colour; each cell is 11 × 11 pixels.
    let cells = html.matches("<td class=\"s-pass\">").count();
    let green = pixels_of(&shot, [0x2e, 0x7d, 0x32], 900);
    assert!(
        green >= cells * 121 * 9 / 10,
        "{green} green pixels on the first screen for {cells} passing cells ({})",
        shot.display()
    );
}

/// A grid cell's link opens its detail: the browser, sent to the cell's anchor, opens that
/// detail and the page's script draws its charts from the data the row carries.
#[test]
fn a_grid_cell_opens_its_detail_with_its_charts() {
    let Some(browser) = chromium() else {
        eprintln!("skipped: no headless Chromium (apt-get install chromium-headless-shell)");
        return;
    };
    let dir = artifacts("small");
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args([
            "matrix",
            "--world-size",
            "2",
            "--configs",
            "ddp,fsdp.full_shard,fsdp.shard_grad_op,tp.2,cp.2",
            "--models",
            "gpt,mlp,nested,transformer",
            "--out",
        ])
        .arg(&dir)
        .output()
        .expect("run the matrix");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = dir.join("report.html");
    let html = std::fs::read_to_string(&page).expect("the page");
    // A cell whose charts are left to the script: a collapsed detail with chart data.
    let id = html
        .split("<details class=\"cell\" id=\"")
        .skip(1)
        .find(|d| {
            let detail = d.split("</details>").next().unwrap_or_default();
            detail.contains("data-chart=") && !detail.contains("<svg")
        })
        .and_then(|d| d.split('"').next())
        .expect("a cell whose charts the script draws")
        .to_owned();
    assert!(
        html.contains(&format!("href=\"#{id}\"")),
        "no grid link to {id}"
    );
    let url = format!("file://{}#{id}", page.display());
    let dom = String::from_utf8_lossy(&browse(&browser, &url, &["--dump-dom"]).stdout).into_owned();
    let opened = dom
        .split(&format!("id=\"{id}\""))
        .nth(1)
        .and_then(|rest| rest.split("</details>").next())
        .expect("the detail in the rendered page");
    let start_tag = opened.split('>').next().unwrap_or_default();
    assert!(
        start_tag.contains("open"),
        "not opened: <details{start_tag}>"
    );
    let charts = opened.matches("class=\"chart\"").count();
    let drawn = opened.matches("<svg class=\"plot\"").count();
    assert!(
        charts > 0 && drawn == charts,
        "{drawn} of {charts} charts drawn"
    );
    assert!(dom.contains("data-ready=\"1\""), "the script did not run");
}
