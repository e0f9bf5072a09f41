// A small Markdown renderer for model answers: fenced code blocks (an unclosed fence,
// as while an answer streams, runs to the end), headings, lists, block quotes, rules,
// paragraphs, and inline code, bold, italics and links. Everything is HTML-escaped
// first; links open only http(s) URLs, and images are shown as links, never loaded,
// so an answer cannot make the page contact another host.
"use strict";

(function (global) {
  function escapeHtml(text) {
    return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");
  }

  function safeHref(url) {
    return /^https?:\/\//i.test(url) ? url : null;
  }

  // Inline markup on one escaped line; code spans are cut out first so their
  // contents stay literal.
  function inline(text) {
    const spans = [];
    let out = text.replace(/`([^`]+)`/g, function (_, code) {
      spans.push("<code>" + code + "</code>");
      return "\u0000" + (spans.length - 1) + "\u0000";
    });
    out = out.replace(/!?\[([^\]]*)\]\(([^)\s]+)\)/g, function (whole, label, url) {
      const href = safeHref(url.replace(/&amp;/g, "&"));
      if (!href) return whole;
      return '<a href="' + escapeHtml(href) + '" target="_blank" rel="noopener noreferrer">' +
        (label || url) + "</a>";
    });
    out = out.replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
      .replace(/__([^_]+)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*])\*([^*\s][^*]*)\*/g, "$1<em>$2</em>")
      .replace(/~~([^~]+)~~/g, "<del>$1</del>");
    return out.replace(/\u0000(\d+)\u0000/g, function (_, i) { return spans[Number(i)]; });
  }

  function renderMarkdown(source) {
    const lines = source.replace(/\r\n?/g, "\n").split("\n");
    const html = [];
    let paragraph = [];
    let list = null; // {tag: "ul"|"ol", items: []}
    let quote = [];

    function flushParagraph() {
      if (paragraph.length) html.push("<p>" + paragraph.map(inline).join("<br>") + "</p>");
      paragraph = [];
    }
    function flushList() {
      if (list) {
        html.push("<" + list.tag + ">" + list.items.map(function (item) {
          return "<li>" + inline(item) + "</li>";
        }).join("") + "</" + list.tag + ">");
      }
      list = null;
    }
    function flushQuote() {
      if (quote.length) html.push("<blockquote>" + renderMarkdown(quote.join("\n")) + "</blockquote>");
      quote = [];
    }
    function flushAll() { flushParagraph(); flushList(); flushQuote(); }

    for (let i = 0; i < lines.length; i++) {
      const raw = lines[i];
      const fence = raw.match(/^\s*(```|~~~)\s*([\w+#.-]*)\s*$/);
      if (fence) {
        flushAll();
        const code = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) code.push(lines[i++]);
        const lang = fence[2] ? '<span class="lang">' + escapeHtml(fence[2]) + "</span>" : "";
        const cls = fence[2] ? ' class="language-' + escapeHtml(fence[2]) + '"' : "";
        html.push("<pre>" + lang + "<code" + cls + ">" + escapeHtml(code.join("\n")) + "</code></pre>");
        continue;
      }
      const line = escapeHtml(raw);
      if (/^\s*$/.test(line)) { flushAll(); continue; }
      const quoted = raw.match(/^\s*>\s?(.*)$/);
      if (quoted) { flushParagraph(); flushList(); quote.push(quoted[1]); continue; }
      flushQuote();
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flushAll();
        const level = heading[1].length;
        html.push("<h" + level + ">" + inline(heading[2]) + "</h" + level + ">");
        continue;
      }
      if (/^\s*([-*_])(\s*\1){2,}\s*$/.test(line)) { flushAll(); html.push("<hr>"); continue; }
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (bullet || numbered) {
        flushParagraph();
        const tag = bullet ? "ul" : "ol";
        if (list && list.tag !== tag) flushList();
        if (!list) list = { tag: tag, items: [] };
        list.items.push((bullet || numbered)[1]);
        continue;
      }
      if (list && /^\s+\S/.test(raw)) { // a continuation line of the last item
        list.items[list.items.length - 1] += " " + line.trim();
        continue;
      }
      flushList();
      paragraph.push(line);
    }
    flushAll();
    return html.join("\n");
  }

  global.renderMarkdown = renderMarkdown;
})(window);
