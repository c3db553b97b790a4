-- Next edits (the server's `dlm/nextEdit`, docs/lsp-extensions.md): after a change and a pause
-- (`next_edit.delay_ms`) with no further change, asks for a suggestion at the cursor and draws it with
-- extmarks: the text it removes highlighted (DlmNextEditDelete: DiffDelete, struck through), the text
-- it adds as virtual text after it (DlmNextEditAdd), further added lines as virtual lines. A
-- suggestion belongs to one buffer version: any change clears it, and accept() applies it only while
-- the buffer is still at that version. Not asked for while ghost text is shown (the completion wins).
local M = {}

local api = vim.api
local ns = api.nvim_create_namespace('dlm.nextedit')
M.ns = ns

local function set_highlights()
  local del = api.nvim_get_hl(0, { name = 'DiffDelete', link = false })
  del.strikethrough = true
  del.default = true
  api.nvim_set_hl(0, 'DlmNextEditDelete', del)
  api.nvim_set_hl(0, 'DlmNextEditAdd', { link = 'DiffAdd', default = true })
end
set_highlights()
api.nvim_create_autocmd('ColorScheme', { group = api.nvim_create_augroup('dlm.nextedit.hl', {}), callback = set_highlights })

---@class dlm.NextEditState
---@field client_id integer
---@field timer uv.uv_timer_t the idle pause
---@field request_id? integer in flight
---@field asked? integer changedtick a request is in flight for
---@field shown? {tick: integer, edits: lsp.TextEdit[], start: integer[], marks: integer[]}

---@type table<integer, dlm.NextEditState>
local state = {}
--- Requests sent, for tests and :DlmStatus.
M.requests = 0

local function config(plugin)
  return plugin.config.next_edit or {}
end

local function version(bufnr)
  local v = vim.lsp.util.buf_versions[bufnr]
  return v or api.nvim_buf_get_changedtick(bufnr)
end

--- True while a completion is shown as ghost text in the buffer (then no next edit is asked for).
local function ghost_shown(bufnr)
  if not api.nvim_get_mode().mode:match('^i') then
    return false -- ghost text lives in insert mode only
  end
  if require('dlm.ghost').get(bufnr) then
    return true
  end
  local inline = vim.api.nvim_get_namespaces()['nvim.lsp.inline_completion']
  return inline ~= nil and #api.nvim_buf_get_extmarks(bufnr, inline, 0, -1, { limit = 1 }) > 0
end

local function cancel(s)
  s.timer:stop()
  if s.request_id then
    local client = vim.lsp.get_client_by_id(s.client_id)
    if client then
      client:cancel_request(s.request_id)
    end
  end
  s.request_id, s.asked = nil, nil
end

--- Hides the suggestion in `bufnr` (the current buffer when nil).
function M.clear(bufnr)
  bufnr = bufnr or api.nvim_get_current_buf()
  local s = state[bufnr]
  if s then
    s.shown = nil
  end
  if api.nvim_buf_is_valid(bufnr) then
    api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
  end
end

--- Gives the shown suggestion {tick, edits, start = {row, col}} (0-based), or nil.
function M.get(bufnr)
  local s = state[bufnr or api.nvim_get_current_buf()]
  return s and s.shown
end

--- Draws `edits` (LSP TextEdits, in order, not overlapping).
local function show(bufnr, client, edits, tick)
  M.clear(bufnr)
  local enc = client.offset_encoding
  local marks = {}
  local first
  for _, e in ipairs(edits) do
    local srow, erow = e.range.start.line, e.range['end'].line
    local lines = api.nvim_buf_get_lines(bufnr, srow, erow + 1, false)
    if #lines < erow - srow + 1 then
      return -- past the end of the buffer: not this version's edit
    end
    local scol = vim.str_byteindex(lines[1], enc, e.range.start.character, false)
    local ecol = vim.str_byteindex(lines[#lines], enc, e.range['end'].character, false)
    first = first or { srow, scol }
    if srow ~= erow or scol ~= ecol then
      marks[#marks + 1] = api.nvim_buf_set_extmark(bufnr, ns, srow, scol, {
        end_row = erow,
        end_col = ecol,
        hl_group = 'DlmNextEditDelete',
        hl_mode = 'combine',
        priority = 200,
      })
    end
    if e.newText ~= '' then
      local added = vim.split(e.newText, '\n', { plain = true })
      local virt_lines = {}
      for i = 2, #added do
        virt_lines[#virt_lines + 1] = { { added[i], 'DlmNextEditAdd' } }
      end
      marks[#marks + 1] = api.nvim_buf_set_extmark(bufnr, ns, erow, ecol, {
        virt_text = added[1] ~= '' and { { added[1], 'DlmNextEditAdd' } } or nil,
        virt_text_pos = 'inline',
        virt_lines = #virt_lines > 0 and virt_lines or nil,
        priority = 200,
      })
    end
  end
  state[bufnr].shown = { tick = tick, edits = edits, start = first, marks = marks }
  api.nvim_exec_autocmds('User', { pattern = 'DlmNextEdit', modeline = false })
end

--- Asks for a suggestion at the cursor, now (the idle pause is over, or :DlmNextEdit).
function M.request(bufnr)
  bufnr = bufnr or api.nvim_get_current_buf()
  local s = state[bufnr]
  local client = s and vim.lsp.get_client_by_id(s.client_id)
  if not client or api.nvim_get_current_buf() ~= bufnr or ghost_shown(bufnr) then
    return
  end
  cancel(s)
  local tick = api.nvim_buf_get_changedtick(bufnr)
  local pos = vim.lsp.util.make_position_params(0, client.offset_encoding).position
  local params = { textDocument = { uri = vim.uri_from_bufnr(bufnr), version = version(bufnr) }, position = pos }
  M.requests = M.requests + 1
  local ok, id = client:request('dlm/nextEdit', params, function(err, result)
    if s.asked ~= tick then
      return -- cancelled or superseded
    end
    s.request_id, s.asked = nil, nil
    if err or type(result) ~= 'table' or type(result.edits) ~= 'table' or #result.edits == 0 then
      return
    end
    if not api.nvim_buf_is_valid(bufnr) or api.nvim_buf_get_changedtick(bufnr) ~= tick or ghost_shown(bufnr) then
      return -- the buffer moved on: this answer is for a version that is gone
    end
    show(bufnr, client, result.edits, tick)
  end, bufnr)
  if ok then
    s.request_id, s.asked = id, tick
  end
end

--- Any change: the suggestion goes, a request in flight is cancelled, the pause starts again.
local function on_change(bufnr, plugin)
  local s = state[bufnr]
  if not s then
    return
  end
  M.clear(bufnr)
  cancel(s)
  local c = config(plugin)
  if c.enabled == false then
    return
  end
  s.timer:start(c.delay_ms or 400, 0, vim.schedule_wrap(function()
    if state[bufnr] and api.nvim_buf_is_valid(bufnr) then
      M.request(bufnr)
    end
  end))
end

--- True when the suggestion's first edit is outside the window's visible lines.
local function off_screen(shown)
  local row = shown.start[1] + 1
  return row < vim.fn.line('w0') or row > vim.fn.line('w$')
end

--- Moves the cursor to the suggestion's first edit; gives false when none is shown.
function M.jump(bufnr)
  local shown = M.get(bufnr)
  if not shown then
    return false
  end
  api.nvim_win_set_cursor(0, { shown.start[1] + 1, shown.start[2] })
  return true
end

--- Applies the shown suggestion (all its edits, one undo step) if the buffer is still at the version
--- it was made for; an off-screen one is jumped to first (a second accept applies it). Gives true when
--- it did something.
function M.accept(bufnr)
  bufnr = bufnr or api.nvim_get_current_buf()
  local s = state[bufnr]
  local shown = s and s.shown
  if not shown then
    return false
  end
  if api.nvim_buf_get_changedtick(bufnr) ~= shown.tick then
    M.clear(bufnr) -- stale: the text changed since it was asked for
    return false
  end
  if off_screen(shown) then
    return M.jump(bufnr)
  end
  local client = vim.lsp.get_client_by_id(s.client_id)
  if not client then
    return false
  end
  M.clear(bufnr)
  vim.lsp.util.apply_text_edits(shown.edits, bufnr, client.offset_encoding)
  return true
end

--- Hides the suggestion and forgets a pending ask; gives false when nothing was shown.
function M.dismiss(bufnr)
  bufnr = bufnr or api.nvim_get_current_buf()
  local s = state[bufnr]
  local was = s and s.shown ~= nil
  if s then
    cancel(s)
  end
  M.clear(bufnr)
  return was
end

--- For `expr` mappings: the keys that run `fn` on the shown suggestion, or nil when none is shown.
function M.keys(bufnr, fn)
  if M.get(bufnr) then
    -- <Cmd> because an expr mapping may not change the buffer itself (textlock).
    return ('<Cmd>lua require("dlm.nextedit").%s(%d)<CR>'):format(fn, bufnr)
  end
end

local function detach(bufnr)
  local s = state[bufnr]
  if not s then
    return
  end
  cancel(s)
  s.timer:close()
  M.clear(bufnr)
  pcall(api.nvim_del_augroup_by_name, 'dlm.nextedit.' .. bufnr)
  state[bufnr] = nil
end

function M.attach(client, bufnr, plugin)
  if state[bufnr] then
    return
  end
  state[bufnr] = { client_id = client.id, timer = assert(vim.uv.new_timer()) }
  local group = api.nvim_create_augroup('dlm.nextedit.' .. bufnr, { clear = true })
  api.nvim_create_autocmd({ 'TextChanged', 'TextChangedI', 'TextChangedP' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      on_change(bufnr, plugin)
    end,
  })
  api.nvim_create_autocmd({ 'BufUnload', 'LspDetach' }, {
    group = group,
    buffer = bufnr,
    callback = function(args)
      if args.event == 'BufUnload' or args.data.client_id == client.id then
        detach(bufnr)
      end
    end,
  })
end

return M
