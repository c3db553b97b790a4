-- dlm-lsp client for Neovim 0.11+: `require('dlm').setup{}`, or `vim.lsp.enable('dlm')` with lsp/dlm.lua.
-- On 0.12+ ghost text is Neovim's own vim.lsp.inline_completion; on 0.11 it is lua/dlm/ghost.lua.
local M = {}

M.defaults = {
  cmd = { 'dlm-lsp', 'serve' },
  filetypes = { 'python', 'javascript', 'javascriptreact', 'typescript', 'typescriptreact', 'go', 'rust' },
  root_markers = { '.git' },
  -- initializationOptions (docs/lsp-extensions.md); `languages` defaults to `filetypes`, no `model`
  -- means the server's bundled default model. `engine = { url = 'http://gpu-box:8765/v1', api =
  -- 'openai-fim' | 'mercury', apiKeyEnv = 'NAME' }` sends fills to a FIM HTTP endpoint instead
  -- (docs/serving.md); the key stays in that environment variable, which the server inherits.
  init_options = {},
  accept_key = '<Tab>', -- insert-mode key that accepts the ghost text; false: map nothing
  debounce_ms = 150, -- 0.11 ghost text only: 0.12's inline completion has its own 200 ms debounce
  ghost_text = 'auto', -- 'auto': Neovim's inline completion where it exists; 'extmark': always ours
  -- Next edits (dlm/nextEdit, lua/dlm/nextedit.lua): after a change and `delay_ms` without another,
  -- a suggestion near the cursor drawn with extmarks. Keys (false: map nothing) act only while one is
  -- shown, else do what they did: accept in normal and insert mode (after ghost text, which wins),
  -- jump and dismiss in normal mode.
  next_edit = {
    enabled = true,
    delay_ms = 400,
    accept_key = '<Tab>', -- applies it (jumps to it first when it is off-screen)
    jump_key = '<S-Tab>', -- moves the cursor to it
    dismiss_key = '<Esc>', -- hides it
  },
}

M.config = vim.deepcopy(M.defaults)
M.enabled = true
--- Last `dlm/status` params per client id.
M.status = {}

local function builtin_inline()
  return M.config.ghost_text == 'auto' and vim.lsp.inline_completion ~= nil
end

--- Gives the initializationOptions sent to the server.
function M.init_options()
  return vim.tbl_extend('force', { languages = M.config.filetypes }, M.config.init_options)
end

--- Gives the server's environment that announces the engine the options pick (DLM_LSP_PRESTART,
--- docs/lsp-extensions.md), so the server starts it before the handshake; nothing for an HTTP endpoint.
function M.prestart_env()
  local o = M.init_options()
  if o.engine ~= nil and type(o.engine) ~= 'string' then
    return {}
  end
  local hint = vim.empty_dict() -- a JSON object even when every option is the server's default
  for _, k in ipairs({ 'model', 'device', 'engine', 'threads' }) do
    if o[k] ~= nil then
      hint[k] = o[k]
    end
  end
  return { DLM_LSP_PRESTART = vim.json.encode(hint) }
end

--- Gives the `vim.lsp.config` table for the `dlm` client (also what lsp/dlm.lua returns).
function M.lsp_config()
  return {
    cmd = M.config.cmd,
    filetypes = M.config.filetypes,
    root_markers = M.config.root_markers,
    init_options = M.init_options(),
    handlers = { ['dlm/status'] = M.on_status },
    on_attach = function(client, bufnr)
      M.on_attach(client, bufnr)
    end,
  }
end

--- `dlm/status` handler: remembers the engine state and tells statuslines through `User DlmStatus`.
--- (Errors need no message here: the server also sends window/showMessage, which Neovim shows.)
function M.on_status(_, params, ctx)
  M.status[ctx.client_id] = params
  vim.api.nvim_exec_autocmds('User', { pattern = 'DlmStatus', modeline = false })
end

--- Gives a short statusline string, e.g. "DLM 132ms", "DLM loading", or "" when no client runs.
function M.statusline()
  for _, client in ipairs(vim.lsp.get_clients({ name = 'dlm', bufnr = 0 })) do
    local s = M.status[client.id]
    if not s then
      return 'DLM'
    end
    local off = M.enabled and '' or ' (off)'
    if s.state == 'ready' and s.lastLatencyMs ~= vim.NIL and s.lastLatencyMs then
      return ('DLM %dms%s'):format(math.floor(s.lastLatencyMs + 0.5), off)
    end
    return 'DLM ' .. s.state .. off
  end
  return ''
end

function M.on_attach(client, bufnr)
  if builtin_inline() then
    vim.lsp.inline_completion.enable(M.enabled, { bufnr = bufnr })
  else
    require('dlm.ghost').attach(client, bufnr, M)
  end
  local ne = M.config.next_edit or {}
  local nextedit = ne.enabled ~= false and (client.server_capabilities.experimental or {}).dlm
    and client.server_capabilities.experimental.dlm.nextEdit == true
  if nextedit then
    require('dlm.nextedit').attach(client, bufnr, M)
  end
  -- the next edit's accept key in insert mode, when it is the ghost text's too: ghost text first
  local shared = nextedit and ne.accept_key == M.config.accept_key
  local key = M.config.accept_key
  if key then
    vim.keymap.set('i', key, function()
      if builtin_inline() then
        if vim.lsp.inline_completion.get() then
          return ''
        end
      else
        local keys = require('dlm.ghost').accept_keys(bufnr)
        if keys then
          return keys
        end
      end
      return shared and require('dlm.nextedit').keys(bufnr, 'accept') or key
    end, { buffer = bufnr, expr = true, desc = 'Accept dlm-lsp ghost text (or next edit)' })
  end
  if nextedit then
    local function map(modes, lhs, fn, desc)
      if lhs then
        vim.keymap.set(modes, lhs, function()
          return require('dlm.nextedit').keys(bufnr, fn) or lhs
        end, { buffer = bufnr, expr = true, desc = desc })
      end
    end
    map(shared and 'n' or { 'n', 'i' }, ne.accept_key, 'accept', 'Accept the dlm-lsp next edit')
    map('n', ne.jump_key, 'jump', 'Go to the dlm-lsp next edit')
    map('n', ne.dismiss_key, 'dismiss', 'Dismiss the dlm-lsp next edit')
  end
end

--- Turns completions on or off in every buffer (nil: flip).
function M.toggle(on)
  if on == nil then
    on = not M.enabled
  end
  M.enabled = on
  for _, client in ipairs(vim.lsp.get_clients({ name = 'dlm' })) do
    for bufnr in pairs(client.attached_buffers) do
      if builtin_inline() then
        vim.lsp.inline_completion.enable(on, { bufnr = bufnr })
      elseif not on then
        require('dlm.ghost').clear(bufnr)
      end
    end
  end
  vim.api.nvim_exec_autocmds('User', { pattern = 'DlmStatus', modeline = false })
end

--- Sends changed initialization options to running servers (workspace/didChangeConfiguration).
function M.configure(opts)
  M.config.init_options = vim.tbl_extend('force', M.config.init_options, opts)
  vim.lsp.config('dlm', { init_options = M.init_options() }) -- for servers started later
  for _, client in ipairs(vim.lsp.get_clients({ name = 'dlm' })) do
    client:notify('workspace/didChangeConfiguration', { settings = { dlm = M.init_options() } })
  end
end

--- Stops the dlm clients and starts them again for the open buffers.
function M.restart()
  vim.lsp.enable('dlm', false)
  vim.wait(5000, function()
    return #vim.lsp.get_clients({ name = 'dlm' }) == 0
  end, 50)
  vim.lsp.enable('dlm')
end

local function create_commands()
  local cmd = vim.api.nvim_create_user_command
  cmd('DlmToggle', function()
    M.toggle()
    vim.notify('dlm-lsp completions ' .. (M.enabled and 'on' or 'off'))
  end, { desc = 'Turn dlm-lsp completions on/off' })
  cmd('DlmRestart', M.restart, { desc = 'Restart dlm-lsp' })
  cmd('DlmNextEdit', function()
    require('dlm.nextedit').request()
  end, { desc = 'Ask dlm-lsp for a next edit at the cursor now' })
  for name, fn in pairs({ Accept = 'accept', Jump = 'jump', Dismiss = 'dismiss' }) do
    cmd('DlmNextEdit' .. name, function()
      require('dlm.nextedit')[fn]()
    end, { desc = fn:gsub('^%l', string.upper) .. ' the dlm-lsp next edit' })
  end
  cmd('DlmStatus', function()
    local line = M.statusline()
    for _, client in ipairs(vim.lsp.get_clients({ name = 'dlm' })) do
      local s = M.status[client.id] or {}
      line = ('%s  [%s on %s]%s'):format(line, s.model or '?', s.device or '?', s.message and s.message ~= vim.NIL and (' ' .. s.message) or '')
    end
    vim.notify(line ~= '' and line or 'dlm-lsp is not running for this buffer')
  end, { desc = 'Show the dlm-lsp engine state' })
end

--- Configures and enables the `dlm` client. `opts` override M.defaults.
function M.setup(opts)
  if vim.fn.has('nvim-0.11') == 0 then
    vim.notify('dlm-lsp needs Neovim 0.11 or newer', vim.log.levels.ERROR)
    return
  end
  M.config = vim.tbl_deep_extend('force', vim.deepcopy(M.defaults), opts or {})
  if vim.fn.executable(M.config.cmd[1]) == 0 then
    vim.notify(
      ('dlm-lsp: "%s" is not executable. Install the dlm-lsp Python package or pass setup{ cmd = { "/path/to/dlm-lsp", "serve" } }.'):format(
        M.config.cmd[1]
      ),
      vim.log.levels.WARN
    )
  end
  local config = M.lsp_config()
  -- Only here, where the options are the plugin's: with vim.lsp.config('dlm', {...}) a user's own
  -- init_options would not match the hint, and the server would start an engine for nothing.
  config.cmd_env = M.prestart_env()
  vim.lsp.config('dlm', config)
  vim.lsp.enable('dlm')
end

create_commands()

return M
