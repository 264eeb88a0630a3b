// Lockstep's report page: opens the detail the address names (a grid cell's link) and draws
// the charts of every row opened, from the data the page carries (`data-chart`), as the
// report's own SVG charts are drawn: loss on a linear axis, distances on a log axis.
(function () {
  // GEOMETRY and KINDS come before this script, from the report's own chart definitions:
  // the plot's size and margins, and per kind of chart its title, axis, whether it is
  // logarithmic, and its series' labels, colours and dashes in the order the data lists them.
  var W = GEOMETRY[0], H = GEOMETRY[1], L = GEOMETRY[2], R = GEOMETRY[3], T = GEOMETRY[4],
    B = GEOMETRY[5];
  function esc(s) {
    return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }
  function fmt(v) {
    return v === 0 ? "0" : v.toExponential(2);
  }
  function expand(d, name) {
    var k = KINDS[d.k];
    return {
      t: k[0] + ": " + name, y: k[1], log: k[2],
      s: d.p.map(function (p, i) {
        var series = k[3][i];
        return { l: series[0], c: series[1], d: series[2], p: p };
      })
    };
  }
  function chart(c) {
    var pw = W - L - R, ph = H - T - B, xs = [], ys = [];
    c.s.forEach(function (s) {
      s.p.forEach(function (p) {
        xs.push(p[0]);
        if (p[1] !== null && (!c.log || p[1] > 0)) ys.push(p[1]);
      });
    });
    var xmax = Math.max(1, Math.max.apply(null, xs.concat([0])));
    var floor = c.log ? (ys.length ? Math.min.apply(null, ys) / 10 : 1e-17) : 0;
    var t = function (v) { return c.log ? Math.log10(Math.max(v, floor)) : v; };
    var tv = ys.map(t), lo = Math.min.apply(null, tv), hi = Math.max.apply(null, tv);
    if (!isFinite(lo)) { lo = 0; hi = 1; }
    if (c.log) { lo = Math.floor(lo); hi = Math.ceil(hi); }
    if (hi - lo < 1e-300) { var pad = lo === 0 ? 1 : Math.abs(lo) * 0.05; lo -= pad; hi += pad; }
    var px = function (x) { return L + x / xmax * pw; };
    var py = function (v) { return T + (1 - (t(v) - lo) / (hi - lo)) * ph; };
    var o = '<svg class="plot" role="img" viewBox="0 0 ' + W + " " + H + '" width="' + W +
      '" height="' + H + '"><title>' + esc(c.t) + '</title><text x="8" y="18" class="t">' +
      esc(c.t) + '</text><rect x="' + L + '" y="' + T + '" width="' + pw + '" height="' + ph +
      '" fill="none" stroke="#999"/>';
    for (var i = 0; i <= 4; i++) {
      var f = i / 4, y = T + (1 - f) * ph, v = lo + f * (hi - lo);
      o += '<line x1="' + L + '" x2="' + (L + pw) + '" y1="' + y + '" y2="' + y +
        '" stroke="#eee"/><text x="' + (L - 4) + '" y="' + (y + 4) + '" text-anchor="end">' +
        (c.log ? "1e" + v.toFixed(1).replace(".0", "") : fmt(v)) + "</text>";
    }
    o += '<text x="' + (L + pw / 2) + '" y="' + (H - 6) + '" text-anchor="middle">step</text>' +
      '<text transform="translate(14 ' + (T + ph / 2) + ') rotate(-90)" text-anchor="middle">' +
      esc(c.y) + "</text>";
    c.s.forEach(function (s, k) {
      var pts = s.p.filter(function (p) { return p[1] !== null; })
        .map(function (p) { return px(p[0]).toFixed(1) + "," + py(p[1]).toFixed(1); });
      var dash = s.d ? ' stroke-dasharray="5 3"' : "";
      o += '<polyline fill="none" stroke="' + s.c + '" stroke-width="1.8"' + dash +
        ' points="' + pts.join(" ") + '"/>';
      var ly = T + 12 + k * 16, lx = L + pw + 10;
      o += '<line x1="' + lx + '" x2="' + (lx + 18) + '" y1="' + ly + '" y2="' + ly +
        '" stroke="' + s.c + '" stroke-width="2"' + dash + '/><text x="' + (lx + 22) +
        '" y="' + (ly + 4) + '">' + esc(s.l) + "</text>";
    });
    return o + "</svg>";
  }
  function draw(root) {
    root.querySelectorAll("div.chart[data-chart]").forEach(function (d) {
      if (d.dataset.drawn) return;
      var row = d.closest("div.row");
      d.innerHTML = chart(expand(JSON.parse(d.dataset.chart), row ? row.dataset.name : ""));
      d.dataset.drawn = "1";
    });
  }
  function show(id) {
    var el = id && document.getElementById(id);
    if (!el) return;
    if (el.tagName === "DETAILS") el.open = true;
    draw(el);
    el.scrollIntoView();
  }
  document.addEventListener("toggle", function (e) {
    if (e.target.open) draw(e.target);
  }, true);
  window.addEventListener("hashchange", function () { show(location.hash.slice(1)); });
  document.querySelectorAll("details[open]").forEach(draw);
  show(location.hash.slice(1));
  document.body.dataset.ready = "1";
})();
