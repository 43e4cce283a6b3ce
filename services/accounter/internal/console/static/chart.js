// Draws the usage page's chart with uPlot from the points the server put in
// #chart's data-points (columns: seconds since the epoch, tokens, requests).
// No request leaves the page: the table below holds the same numbers.
(function () {
  "use strict";
  var el = document.getElementById("chart");
  if (!el || typeof uPlot === "undefined") return;
  var data = JSON.parse(el.getAttribute("data-points") || "[[],[],[]]");
  var from = Number(el.getAttribute("data-from")), to = Number(el.getAttribute("data-to"));
  function size() {
    return { width: Math.max(el.clientWidth, 280), height: window.innerWidth < 640 ? 220 : 300 };
  }
  var opts = Object.assign(size(), {
    scales: { x: { time: true, range: function () { return [from, to]; } } },
    tzDate: function (ts) { return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); },
    series: [
      {},
      { label: "Tokens", stroke: "#0b57d0", width: 2, scale: "tokens" },
      { label: "Requests", stroke: "#b3261e", width: 2, dash: [6, 4], scale: "requests" }
    ],
    axes: [
      {},
      { scale: "tokens", label: "tokens" },
      { scale: "requests", side: 1, label: "requests", grid: { show: false } }
    ]
  });
  var plot = new uPlot(opts, data, el);
  window.addEventListener("resize", function () { plot.setSize(size()); });
})();
