-- Default config for `vim.lsp.enable('dlm')` (Neovim 0.11+); `vim.lsp.config('dlm', {...})` overrides it.
return require('dlm').lsp_config()
