-- Ghost text for Neovim 0.11, which has no vim.lsp.inline_completion: asks for a fill after a pause in
-- typing, shows it as extmarks at the cursor, accepts it on a key, and drops it as soon as the text or
-- the cursor moves away from where it was asked for.
local M = {}

local api = vim.api
local ns = api.nvim_create_namespace('dlm.ghost')
api.nvim_set_hl(0, 'DlmGhost', { link = 'Comment', default = true })

---@class dlm.GhostState
---@field client_id integer
---@field timer uv.uv_timer_t debounce timer
---@field want? string spot (see spot()) a request is pending or in flight for
---@field request_id? integer in-flight request
---@field ghost? {spot: string, row: integer, col: integer, end_col: integer, text: string}

---@type table<integer, dlm.GhostState>
local state = {}

--- Gives a key for "this text, this cursor": a fill is only valid for the spot it was asked for.
local function spot(bufnr)
  local row, col = unpack(api.nvim_win_get_cursor(0))
  return ('%d:%d:%d'):format(api.nvim_buf_get_changedtick(bufnr), row, col)
end

local function cancel(s)
  s.timer:stop()
  if s.request_id then
    local client = vim.lsp.get_client_by_id(s.client_id)
    if client then
      client:cancel_request(s.request_id)
    end
    s.request_id = nil
  end
  s.want = nil
end

function M.clear(bufnr)
  local s = state[bufnr]
  if s then
    s.ghost = nil
  end
  if api.nvim_buf_is_valid(bufnr) then
    api.nvim_buf_clear_namespace(bufnr, ns, 0, -1)
  end
end

--- Shows `item` at the cursor, skipping what its range says the user already typed.
local function show(bufnr, client, item, at)
  local text = type(item.insertText) == 'table' and item.insertText.value or item.insertText
  local row, col = unpack(api.nvim_win_get_cursor(0))
  row = row - 1
  local line = api.nvim_buf_get_lines(bufnr, row, row + 1, true)[1]
  local start_col, end_col = col, col
  if item.range then
    if item.range.start.line ~= row or item.range['end'].line ~= row then
      return -- only single-line ranges on the cursor line are valid for inline completion
    end
    start_col = vim.str_byteindex(line, client.offset_encoding, item.range.start.character, false)
    end_col = vim.str_byteindex(line, client.offset_encoding, item.range['end'].character, false)
  end
  local typed = line:sub(start_col + 1, col)
  if start_col > col or end_col < col or text:sub(1, #typed) ~= typed or #text == #typed then
    return
  end
  local lines = vim.split(text:sub(#typed + 1), '\n', { plain = true })
  -- A one-line fill that replaces text after the cursor (say a closing bracket) usually ends with that
  -- text; leave it to the real characters instead of showing it twice.
  local replaced = line:sub(col + 1, end_col)
  if #lines == 1 and replaced ~= '' and lines[1]:sub(-#replaced) == replaced then
    lines[1] = lines[1]:sub(1, -#replaced - 1)
  end
  local virt_lines = {}
  for i = 2, #lines do
    virt_lines[#virt_lines + 1] = { { lines[i], 'DlmGhost' } }
  end
  M.clear(bufnr)
  api.nvim_buf_set_extmark(bufnr, ns, row, col, {
    virt_text = { { lines[1], 'DlmGhost' } },
    virt_text_pos = 'inline',
    virt_lines = #virt_lines > 0 and virt_lines or nil,
    hl_mode = 'combine',
  })
  state[bufnr].ghost = { spot = at, row = row, col = start_col, end_col = end_col, text = text }
end

local function request(bufnr)
  local s = state[bufnr]
  local client = vim.lsp.get_client_by_id(s.client_id)
  local at = spot(bufnr)
  if not client or s.want ~= at or api.nvim_get_current_buf() ~= bufnr or not api.nvim_get_mode().mode:match('^i') then
    s.want = nil
    return
  end
  local params = vim.lsp.util.make_position_params(0, client.offset_encoding)
  params.context = { triggerKind = 2 } -- Automatic
  local ok, id = client:request('textDocument/inlineCompletion', params, function(err, result)
    if s.want ~= at then
      return -- superseded: a newer request owns the spot (this one was cancelled)
    end
    s.want, s.request_id = nil, nil
    if err or not result or spot(bufnr) ~= at or not api.nvim_get_mode().mode:match('^i') then
      return
    end
    local item = (result.items or result)[1]
    if item then
      show(bufnr, client, item, at)
    end
  end, bufnr)
  s.request_id = ok and id or nil
end

--- Text or cursor changed: drop the stale ghost, cancel the old request, ask again after the pause.
local function on_change(bufnr, plugin)
  local s = state[bufnr]
  local at = spot(bufnr)
  if s.ghost and s.ghost.spot == at then
    return -- e.g. CursorMovedI right after the fill was shown: nothing moved
  end
  M.clear(bufnr)
  if s.want == at then
    return -- TextChangedI and CursorMovedI both fire per keystroke; one request is enough
  end
  cancel(s)
  if plugin.enabled then
    s.want = at
    s.timer:start(plugin.config.debounce_ms, 0, vim.schedule_wrap(function()
      if state[bufnr] then
        request(bufnr)
      end
    end))
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
  pcall(api.nvim_del_augroup_by_name, 'dlm.ghost.' .. bufnr)
  state[bufnr] = nil
end

function M.attach(client, bufnr, plugin)
  if state[bufnr] then
    return
  end
  state[bufnr] = { client_id = client.id, timer = assert(vim.uv.new_timer()) }
  local group = api.nvim_create_augroup('dlm.ghost.' .. bufnr, { clear = true })
  api.nvim_create_autocmd({ 'InsertEnter', 'TextChangedI', 'CursorMovedI' }, {
    group = group,
    buffer = bufnr,
    callback = function()
      on_change(bufnr, plugin)
    end,
  })
  api.nvim_create_autocmd('InsertLeave', {
    group = group,
    buffer = bufnr,
    callback = function()
      cancel(state[bufnr])
      M.clear(bufnr)
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

--- Gives the current ghost text, or nil.
function M.get(bufnr)
  local s = state[bufnr or api.nvim_get_current_buf()]
  return s and s.ghost and s.ghost.text
end

--- Inserts the ghost text and moves the cursor after it; gives false when none is shown.
function M.accept(bufnr)
  bufnr = bufnr or api.nvim_get_current_buf()
  local s = state[bufnr]
  local g = s and s.ghost
  if not g then
    return false
  end
  cancel(s)
  M.clear(bufnr)
  local lines = vim.split(g.text, '\n', { plain = true })
  api.nvim_buf_set_text(bufnr, g.row, g.col, g.row, g.end_col, lines)
  local last_col = (#lines == 1 and g.col or 0) + #lines[#lines]
  api.nvim_win_set_cursor(0, { g.row + #lines, last_col })
  return true
end

--- For an `expr` mapping: gives the keys that accept the shown ghost text, or nil when none is shown.
function M.accept_keys(bufnr)
  if state[bufnr] and state[bufnr].ghost then
    -- <Cmd> because an expr mapping may not change the buffer itself (textlock).
    return ('<Cmd>lua require("dlm.ghost").accept(%d)<CR>'):format(bufnr)
  end
end

return M
